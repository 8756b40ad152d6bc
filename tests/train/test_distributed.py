"""Two ranks over gloo (as torchrun would start them): DDP keeps the drafts identical and the run completes."""

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from eyas.dist.launch import free_port
from eyas.models.tokenizer import load_tokenizer
from eyas.train.conversation import encode_conversation
from tests.train.conftest import CONVERSATIONS


def _worker(rank: int, world: int, port: int, target_dir: str, out: str):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from eyas.train.distributed import init_distributed
    from tests.train.test_trainer import make_trainer

    info = init_distributed("cpu")
    tok = load_tokenizer(target_dir)
    samples = [encode_conversation(tok, c, 128) for c in CONVERSATIONS * 4]
    tr = make_trainer(target_dir, samples, Path(out), steps=4, checkpoint_every=2, batch_tokens=256, dist_info=info)
    assert isinstance(tr.ddp, torch.nn.parallel.DistributedDataParallel)
    first_batch = tr.source.stream.next().ids
    tr.source.stream.load_state({"epoch": 0, "index": 0})
    tr.fit()
    torch.save({"state": tr.draft.state_dict(), "first_batch": first_batch, "step": tr.step},
               os.path.join(out, f"rank{rank}.pt"))
    info.close()


def test_two_ranks_end_with_identical_weights(tiny_target, tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tiny_target), str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert a["step"] == b["step"] == 4
    assert a["first_batch"] != b["first_batch"]  # each rank trained on its own share of the data
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert (tmp_path / "checkpoints" / "step-000004" / "draft.safetensors").is_file()
    rows = (tmp_path / "metrics.jsonl").read_text().strip().splitlines()
    assert len(rows) == 4  # rank 0 alone writes the metrics
