import pytest, torch, rank_cases

@pytest.mark.parametrize("algo,shape", [("one_shot", (2, 64)), ("lamport", (2, 64)), ("one_shot", (8, 64)), ("lamport", (8, 64)), ("lamport", (1, 64))])
def test_probe_timeout(pool2, algo, shape):
    rs = pool2.run(rank_cases.peer_timeout_case, 0.5, "all_reduce" if shape[0] != 8 else "fused", shape, torch.bfloat16, algo=algo)
    print(algo, shape, rs[0]["seen"], rs[0]["elapsed"], rs[0]["again"], rs[0]["polls_timeout"])
