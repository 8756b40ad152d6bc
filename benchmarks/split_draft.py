"""Split a draft's model.safetensors into shards of at most 15 MiB (the device tool returns files up to 16 MiB).

Usage: python benchmarks/split_draft.py SRC_DIR DST_DIR
"""

import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

LIMIT = 15 * 1024 * 1024


def main(src: str, dst: str):
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    shards, cur, size = [], {}, 0
    for k, v in sorted(tensors.items(), key=lambda kv: -kv[1].numel()):
        n = v.numel() * v.element_size()
        if cur and size + n > LIMIT:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v.contiguous()
        size += n
    shards.append(cur)
    for i, shard in enumerate(shards):
        save_file(shard, str(dst / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")


if __name__ == "__main__":
    main(*sys.argv[1:3])
