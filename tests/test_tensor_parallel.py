"""TPContext collectives over two real gloo processes."""

import torch.multiprocessing as mp

from eyas.dist.launch import free_port


def _agree(rank, port, flags, out):
    import torch.distributed as dist

    from eyas.tensor_parallel import TPContext

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = TPContext(rank, 2, dist.group.WORLD)
    out.put((rank, [ctx.agree(f) for f in flags[rank]]))
    dist.destroy_process_group()


def test_every_rank_follows_rank_zeros_choice():
    port = free_port()
    flags = {0: [True, False, True], 1: [False, False, True]}  # rank 1's own choices differ at first
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree, args=(r, port, flags, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: flags[0], 1: flags[0]}
