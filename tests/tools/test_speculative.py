"""Speculative decoding under tensor parallelism (``tpcomm.models.speculative``): an Eagle-style draft head
proposing K = 3 tokens a step for a sharded MiniMax-M2, verified greedily, on 2 CPU ranks and on 4 with
2 key-value heads (each on 2 ranks: ``kv_replicas``, as deployed with more ranks than key-value heads).
The accepted tokens are plain greedy decoding's; every rank's draft tokens, target tokens, accepted counts
and logits' bits agree at every step (gathered, not assumed); the communicator's calls alternate between
the draft's token counts and the target's. Skipped without ``transformers``."""

import pytest
import torch

pytest.importorskip("transformers")

from tests.support.numerics import Checks  # noqa: E402
from tests.tools import ranks  # noqa: E402

K = 3
#: (world, key-value heads, target layers, tokens): runs whose seeded target both repeats a token (the
#: draft's proposals accepted) and changes token (rejected) within the tokens decoded, with few steps
#: (each step is a dozen calls under the interpreter).
CASES = [(2, None, 1, 8), (4, 2, 2, 8)]


def _expected_runs_ok(runs: list, k: int, layers: int, prompt: int) -> str | None:
    """Why the calls' ``(model, tokens, calls)`` runs are not a speculative run's, or None: the target's
    prefill, then per step the draft (its extend over the prompt or the 1 to ``k + 1`` tokens accepted,
    and ``k - 1`` one-token steps, 2 calls a forward pass) and the target's verification of ``k + 1``
    tokens (3 calls a layer)."""
    if not runs or runs[0][0] != "target":
        return f"the first calls are not the target's prefill: {runs[:2]}"
    models = [m for i, (m, _, _) in enumerate(runs) if i == 0 or runs[i - 1][0] != m]
    if models != ["target", "draft"] * (len(models) // 2) + ["target"] * (len(models) % 2):
        return f"the models do not alternate: {models}"
    for model, tokens, calls in runs[1:]:
        if model == "target" and (tokens, calls) != (k + 1, 3 * layers):
            return f"a target run of {calls} calls of {tokens} tokens, expected {3 * layers} of {k + 1}"
        if model == "draft" and (not 1 <= tokens <= max(k + 1, prompt) or calls % 2):
            return f"a draft run of {calls} calls of {tokens} tokens"
    return None


@pytest.mark.parametrize("world,kv_heads,layers,steps", CASES, ids=["w2", "w4-kv_heads2"])
def test_speculative_decoding_agrees_on_every_rank(pools, world, kv_heads, layers, steps):
    """float32: the tokens equal the unsharded target's greedy tokens; at every step all ranks had the
    same draft tokens, target tokens, accepted count and logits' bits; the same calls on every rank, the
    draft's and the target's token counts alternating; some steps accepted proposals and some rejected
    one (the draft proposes the last token again, which the target keeps where it repeats a token)."""
    check = Checks()
    prompt = ranks.small("minimax_m2", world).prompt
    for r, res in enumerate(pools.get(world).run(ranks.speculative_case, K, steps, layers, kv_heads, timeout_s=600)):
        check.that(res["kernels"], f"rank {r}: the communicator fell back")
        check.that(res["tokens"] == res["ref_tokens"], f"rank {r}: tokens {res['tokens']} != {res['ref_tokens']}")
        check.that(len(res["agreed"]) == len(res["accepted"]) > 0 and all(res["agreed"]),
                   f"rank {r}: the ranks disagreed at steps {[i for i, a in enumerate(res['agreed']) if not a]}")
        check.that(res["same_on_ranks"] and res["calls_same"], f"rank {r}: tokens or calls differ between ranks")
        accepted = res["accepted"]
        check.that(any(n > 0 for n in accepted) and any(n < K for n in accepted),
                   f"rank {r}: accepted per step {accepted}: expected some accepted and some rejected proposals")
        why = _expected_runs_ok(res["runs"], K, layers, prompt)
        check.that(why is None, f"rank {r}: {why}")
    check.done()


def test_unsharded_speculative_decoding_is_greedy_decoding():
    """The algorithm alone (one process, no communicator): K = 1 and 3 give the greedy tokens, each step
    emits its accepted proposals and one token more; K = 0 is refused by name."""
    from tpcomm.models import demo
    from tpcomm.models.speculative import greedy_reference, make_draft, speculative_greedy

    cfg = ranks.small("minimax_m2", 2)
    model = demo.make_model(cfg)
    draft = make_draft(model, 1)
    prompt = torch.randint(3, cfg.vocab, (1, cfg.prompt), generator=torch.Generator().manual_seed(3))
    ref = greedy_reference(model, prompt, 8)
    for k in (1, 3):
        run = speculative_greedy(model, draft, prompt, 8, k)
        assert torch.equal(run.tokens, ref), (k, run.tokens.tolist(), ref.tolist())
        assert 1 + sum(n + 1 for n in run.accepted) >= 8 > 1 + sum(n + 1 for n in run.accepted[:-1]), run.accepted
    with pytest.raises(ValueError, match="k and steps must be >= 1"):
        speculative_greedy(model, draft, prompt, 10, 0)
