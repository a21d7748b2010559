"""``examples/tp_decoder.py``: the tensor-parallel decoder stack on CPU ranks (eager and compiled),
checked against its single-process float64 reference; its checker fails wrong outputs; bad arguments
are refused before any rank starts. The GPU run (compile + CUDA graphs) is in tests/ops/test_gpu_graphs.py.
"""

import dataclasses
import os
import sys

import pytest
import torch

from tests.ops import ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import tp_decoder  # noqa: E402


def _cfg(world_size):
    # aot_eager: the same traced graph (dynamo, functionalization, the ops' fake impls) as Inductor,
    # without generating C++ (Inductor on CPU works too, but compiles C++ for tens of seconds).
    return tp_decoder.Config("cpu", world_size, layers=2, tokens=3, hidden=32, heads=4, intermediate=64,
                             compile=True, backend="aot_eager")


def test_example_matches_the_single_process_reference(pool2):
    cfg = _cfg(pool2.world_size)
    results = pool2.run(ranks.example_case, dataclasses.asdict(cfg), timeout_s=300)
    rows, ok = tp_decoder.check(cfg, results)
    assert ok, rows
    assert [r[0] for r in rows] == ["eager", "compiled"]
    assert all(r["uses_kernels"] and r["compiles"] == 1 for r in results)


def test_checker_fails_a_wrong_output():
    """The example's check against the reference: a correct output passes, one rank's output off by
    a small amount (or differing between ranks) fails."""
    cfg = dataclasses.replace(_cfg(2), compile=False)
    ref = tp_decoder.reference_forward(cfg, tp_decoder.make_weights(cfg), tp_decoder.make_input(cfg, 0)).float()

    def result(out):
        return {"outputs": {"eager": out}, "digests": {"eager": tp_decoder._digest(out)}, "graph_matches": []}

    assert tp_decoder.check(cfg, [result(ref), result(ref.clone())])[1]
    wrong = ref.clone()
    wrong[0, 0] += 1e-2 * ref.norm()
    assert not tp_decoder.check(cfg, [result(ref), result(wrong)])[1]
    assert not tp_decoder.check(cfg, [result(ref), result(torch.nextafter(ref, ref + 1))])[1]  # ranks differ


@pytest.mark.parametrize("argv,message", [(["--hidden", "48", "--heads", "3"], "multiples of the world size"),
                                          (["--graph"], "CUDA graphs need"), (["--layers", "0"], "layers")])
def test_bad_arguments_are_refused_before_launch(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tp_decoder.main(["--device", "cpu", "--world", "2"] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_cuda_without_two_gpus_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        tp_decoder.main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda needs at least 2 GPUs" in capsys.readouterr().err
