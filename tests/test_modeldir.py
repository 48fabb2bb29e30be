"""``kvmesh model init``: a model directory both engines and intake load, with no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.modeldir import SPECIAL_TOKENS, init_model_dir
from kvmesh.modeldir import main as model_main
from kvmesh_core.tokenizer import ChatMessage, HFTokenizer, load_tokenizer, render_chat, render_history
from schemas.blocks import block_hashes, tenant_namespace
from services.worker.config import WorkerSettings, model_dir_of, served_model_for
from services.worker.engine_api import EngineRequest
from services.worker.engines import build_engine
from services.worker.errors import ModelConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("m") / "tiny-llama"
    assert model_main(["init", str(root), "--layers", "2", "--d-model", "128", "--ffn-dim", "256"]) == 0
    return root


def test_the_directory_is_a_hugging_face_llama_checkpoint(model_dir: Path) -> None:
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / f).is_file(), f
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] % 64 == 0
    tok = HFTokenizer(model_dir)
    assert tok.vocab_size <= cfg["vocab_size"]
    assert (tok.bos_id, tok.end_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.chat_template is not None


def test_same_seed_same_model_other_seed_other_weights(tmp_path: Path) -> None:
    a = init_model_dir(tmp_path / "a", seed=1, layers=1, d_model=64, ffn_dim=128, heads=2, kv_heads=1)
    b = init_model_dir(tmp_path / "b", seed=1, layers=1, d_model=64, ffn_dim=128, heads=2, kv_heads=1)
    c = init_model_dir(tmp_path / "c", seed=2, layers=1, d_model=64, ffn_dim=128, heads=2, kv_heads=1)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_the_chat_template_is_prefix_stable_and_keeps_markers_apart(model_dir: Path) -> None:
    tok = load_tokenizer(str(model_dir))
    turn1 = [ChatMessage("system", "Be brief."), ChatMessage("user", "What is a cache?")]
    p1 = render_chat(tok, turn1)
    history = render_history(tok, [*turn1, ChatMessage("assistant", "A store.")])
    p2 = render_chat(tok, [*turn1, ChatMessage("assistant", "A store."), ChatMessage("user", "Why?")])
    assert history[: len(p1)] == p1 and p2[: len(history)] == history
    assert p1[0] == tok.bos_id and p1.count(tok.end_id) == 2
    # every marker is one special token, never merged with text around it
    assert isinstance(tok, HFTokenizer)
    specials = {tok.encode(s)[0] for s in SPECIAL_TOKENS}
    assert all(len(tok.encode(s)) == 1 for s in SPECIAL_TOKENS)
    assert set(p1) & specials >= {tok.bos_id, tok.end_id}
    # any text survives encode -> decode
    text = "Grüße, 1234 tokens! ünïcödé"
    assert tok.decode(tok.encode(text)) == text


def test_the_builtin_engine_loads_it_by_directory(model_dir: Path) -> None:
    settings = WorkerSettings(model=str(model_dir), insecure_dev_transfer=True, gpu_blocks=64, dram_blocks=0)
    assert settings.served_model == "kvmesh-tiny-llama" == served_model_for(str(model_dir))
    eng = build_engine(settings)
    assert eng.kind == "builtin" and eng.model_name == "tiny-llama"
    ids = render_chat(eng.tokenizer, [ChatMessage("user", "Say something.")])
    ns = tenant_namespace("t")
    eng.add_request(EngineRequest("r", "s", ids, block_hashes(ids, eng.block_size, ns), ns, max_tokens=6))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step():
            out += o.new_token_ids
    assert len(out) == 6 and len(set(out)) > 1
    eng.release_all()


def test_model_names_and_paths() -> None:
    assert model_dir_of("tiny") is None and model_dir_of("kvmesh-small") is None
    assert served_model_for("tiny") == "kvmesh-tiny"
    with pytest.raises(ModelConfigError, match="nor an existing local model directory"):
        model_dir_of("/no/such/model", must_exist=True)
    with pytest.raises(ModelConfigError, match="no-such-size"):
        WorkerSettings(model="no-such-size", insecure_dev_transfer=True).model_dir()


def test_tools_render_only_through_a_template_that_has_them(model_dir: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(model_dir))
    assert isinstance(tok, HFTokenizer) and tok.supports_tools
    msgs = [ChatMessage("user", "Which block?")]
    tool = {"type": "function", "function": {"name": "get_block", "parameters": {"type": "object"}}}
    plain = render_chat(tok, msgs)
    with_tools = render_chat(tok, msgs, tools=[tool])
    assert plain != with_tools and "get_block" in tok.decode(with_tools)
    assert "<tool_call>" in tok.decode(with_tools)  # the Hermes convention intake parses
    called = [*msgs, ChatMessage("assistant", "", (("get_block", '{"hash": 7}'),))]
    assert '"hash": 7' in tok.decode(render_chat(tok, called, add_generation_prompt=False))
    # a template without tools: refusing beats dropping them from the prompt
    other = tmp_path / "no-tools"
    other.mkdir()
    for f in model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    conf = json.loads((other / "tokenizer_config.json").read_text())
    conf["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(conf))
    bare = load_tokenizer(str(other))
    assert isinstance(bare, HFTokenizer) and not bare.supports_tools
    assert render_chat(bare, msgs)
    with pytest.raises(ValueError, match="does not render tools"):
        render_chat(bare, msgs, tools=[tool])
    with pytest.raises(ValueError, match="does not render tools"):
        render_chat(bare, called)
