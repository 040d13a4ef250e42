"""Bad checkpoint files: a damaged or hostile GGUF header or config.json is refused with
one line naming the file and the field, or it loads a model that answers correctly.
Never a traceback of another exception type, never a model that serves wrong answers.

Oracles: for a config.json mutation that ferroxmp accepts, transformers' greedy tokens
on the same mutated folder; for a GGUF header mutation that it accepts, the unmutated
file's config and weights (bit for bit) and its greedy tokens. A refusal must be a
CheckpointError whose `field` is named in its one-line message.
"""
from __future__ import annotations

import functools
import glob
import inspect
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import RunnerHarness
from ferroxmp.checkpoint.limits import CheckpointError
from ferroxmp.checkpoint.validate import validate_checkpoint
from ferroxmp.gpu_worker.loader import load_config, load_weights
from gguf_writer import header_fields, write_gguf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 77, 301, 12, 640, 9]
NEW = 5
# ModelConfig fields a GGUF header may legitimately change -> their config.json names
SEMANTIC = {"rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling"}
SHAPE = os.environ.get("FERROXMP_FUZZ_SHAPE", "llama")  # the tiny checkpoint both fuzzers mutate
EXAMPLES = int(os.environ.get("FERROXMP_FUZZ_EXAMPLES", "20"))  # more for a deeper search; GGUF runs 3x
# (a refused header costs milliseconds; an accepted config.json costs a transformers load)


def ferro_greedy(path: str) -> list[int]:
    """ferroxmp's greedy tokens for PROMPT, in process, float32."""
    from ferroxmp.gpu_worker.runner import ModelRunner
    kw = {"dtype": "float32"}
    if "quantization" in inspect.signature(ModelRunner).parameters:
        kw["quantization"] = "none"  # the weights as stored: int8 serving has its own tolerance tests
    with mock.patch("ferroxmp.gpu_worker.runner.ModelRunner", functools.partial(ModelRunner, **kw)):
        h = RunnerHarness(path, page_size=16, max_rows=1, pages_per_row=2)
    try:
        return h.generate({0: PROMPT}, NEW)[0][0]
    finally:
        h.close()


FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "factor", "low_freq_factor", "high_freq_factor")


def _as_transformers_types(folder: str) -> None:
    """An integer where config.json means a float (rms_norm_eps 1) is the same number to
    ferroxmp; transformers' strict config classes refuse it, so its copy gets 1.0."""
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    for d in (cfg, cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}):
        for k in FLOAT_FIELDS:
            if type(d.get(k)) is int:
                d[k] = float(d[k])
    json.dump(cfg, open(path, "w"))


def hf_greedy(folder: str) -> list[int]:
    copy = os.path.join(tempfile.mkdtemp(dir=os.path.dirname(folder)), "hf")
    shutil.copytree(folder, copy)
    _as_transformers_types(copy)
    folder = copy
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(PROMPT):].tolist()


def refused(fn, *args) -> CheckpointError | None:
    """Run fn; a CheckpointError is returned after checking it is a clear refusal (one
    line, a field it names); any other exception fails the test."""
    try:
        fn(*args)
    except CheckpointError as e:
        msg = str(e)
        assert e.field, f"no field named: {msg}"
        assert "\n" not in msg and e.field in msg, msg
        return e
    return None


def load_all(path: str):
    """What serve and the worker do before the first request: validate, config, weights."""
    validate_checkpoint(path)
    return load_config(path), load_weights(path, torch.device("cpu"), torch.float32)


# ---- GGUF -------------------------------------------------------------------------

class Base(dict):
    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"<{self.get('path') or self.get('folder')}>"


@pytest.fixture(scope="module")
def base_gguf(tiny_models, tmp_path_factory):
    """The tiny Llama (rope_freqs, Q/K permutation, untied head) as an F32 GGUF, its
    header layout, its config, weights and greedy answer."""
    path = write_gguf(tiny_models[SHAPE], str(tmp_path_factory.mktemp("fuzz") / f"{SHAPE}.gguf"), Q.F32)
    cfg, weights = load_all(path)
    return Base({"path": path, "folder": tiny_models[SHAPE], "bytes": open(path, "rb").read(),
                 "fields": header_fields(path), "cfg": cfg, "weights": weights, "answer": ferro_greedy(path)})


def _fits(fmt: str, v: int) -> int:
    bits = struct.calcsize(fmt) * 8
    if fmt[-1].islower() and fmt[-1] not in "f?d":  # signed
        return (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    return v % (1 << bits)


def _mutate(data: bytes, offset: int, fmt: str, how: str, k: int) -> bytes:
    (old,) = struct.unpack_from(fmt, data, offset)
    if fmt in ("<f", "<d"):
        new = {"zero": 0.0, "neg": -abs(old) - 1, "big": 1e30, "nan": float("nan"), "inf": float("inf"),
               "plus": old + k, "double": old * 2, "half": old / 2, "max": 3e38, "minus": old - k, "val": k}[how]
    elif fmt == "<?":
        new = not old
    else:
        new = _fits(fmt, {"zero": 0, "neg": -k, "big": 1 << 40, "nan": 1 << 62, "inf": -1, "plus": old + k,
                          "double": old * 2, "half": old // 2, "max": (1 << 64) - 1, "minus": old - k, "val": k}[how])
    return data[:offset] + struct.pack(fmt, new) + data[offset + struct.calcsize(fmt):]


HOW = st.sampled_from(["zero", "neg", "big", "nan", "inf", "plus", "double", "half", "max", "minus", "val"])


@settings(max_examples=3 * EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutated_gguf_header_is_refused_by_field_or_loads_the_same_model(base_gguf, tmp_path_factory, data):
    """One header field (a count, a string or array length, a value type, a tensor's dims,
    type or offset, a metadata value) gets an edge value, or the file is cut short. Pins
    down: struct.error / OverflowError / ZeroDivisionError / IndexError tracebacks from
    the reader, and files that load a different model without an error."""
    fields = base_gguf["fields"]
    raw = base_gguf["bytes"]
    if data.draw(st.integers(0, 9), label="truncate?") == 0:
        cut = data.draw(st.integers(0, len(raw) - 1), label="cut at")
        mutated, label = raw[:cut], f"cut at {cut}"
    else:
        label, offset, fmt = data.draw(st.sampled_from(fields), label="field")
        how, k = data.draw(HOW, label="how"), data.draw(st.integers(1, 1 << 20), label="k")
        mutated = _mutate(raw, offset, fmt, how, k)
    path = os.path.join(tempfile.mkdtemp(dir=str(tmp_path_factory.getbasetemp())), "m.gguf")
    with open(path, "wb") as f:
        f.write(mutated)
    if mutated == raw or refused(load_all, path) is not None:
        return
    cfg, weights = load_all(path)
    assert sorted(weights) == sorted(base_gguf["weights"]), label
    assert all(torch.equal(weights[n], t) for n, t in base_gguf["weights"].items()), f"{label}: other weights"
    base = vars(base_gguf["cfg"])
    changed = {k for k, v in vars(cfg).items() if base[k] != v} - {"max_position_embeddings", "eos_token_ids"}
    assert changed <= set(SEMANTIC), f"{label}: loaded a different config: {changed}"
    if cfg.max_position_embeddings < len(PROMPT) + NEW:
        return  # the scheduler refuses a prompt longer than the context
    if not changed:  # the same model: the unmutated file's answer
        assert ferro_greedy(path) == base_gguf["answer"], label
        return
    # a different norm epsilon or rope base is a different model: transformers on the
    # source folder with the same values in config.json is the oracle
    folder = os.path.join(tempfile.mkdtemp(dir=str(tmp_path_factory.getbasetemp())), "m")
    changes = {SEMANTIC[k]: getattr(cfg, k) for k in changed}
    _hf_variant(base_gguf["folder"], folder, **changes)
    assert ferro_greedy(path) == hf_greedy(folder), f"{label}: {changes}"


def _gguf_variant(tiny_models, tmp, name: str, **kw) -> str:
    return write_gguf(tiny_models["llama"], str(tmp / name), Q.F32, **kw)


def _patch(path: str, label: str, value: int, fields=None, nth: int = 0) -> str:
    """Set header field `label` (its nth occurrence) of the file at `path` to `value`."""
    fields = fields or header_fields(path)
    offset, fmt = [(o, f) for name, o, f in fields if name == label][nth]
    data = open(path, "rb").read()
    out = path.replace(".gguf", f"-{label.replace(' ', '_')}.gguf")
    with open(out, "wb") as f:
        f.write(data[:offset] + struct.pack(fmt, _fits(fmt, value)) + data[offset + struct.calcsize(fmt):])
    return out


def _explicit_gguf_cases(tiny_models, tmp) -> dict[str, tuple[str, str]]:
    """name -> (file, a text the refusal's field must contain)."""
    base = _gguf_variant(tiny_models, tmp, "base.gguf")
    embed = load_file(os.path.join(tiny_models["llama"], "model.safetensors"))
    small = {"token_embd.weight": (embed["model.embed_tokens.weight"][:100].float().numpy(), Q.F32),
             "output.weight": (embed["lm_head.weight"][:100].float().numpy(), Q.F32)}
    data = open(base, "rb").read()
    cut = os.path.join(str(tmp), "truncated.gguf")
    with open(cut, "wb") as f:
        f.write(data[:len(data) - 1000])
    head_cut = os.path.join(str(tmp), "header-cut.gguf")
    with open(head_cut, "wb") as f:
        f.write(data[:200])
    return {
        "0 heads": (_patch(base, "llama.attention.head_count", 0), "head_count"),
        "vocab 0 (no embedding rows)": (_patch(base, "token_embd.weight dim 1", 0), "token_embd.weight"),
        "embedding with 100 rows for a 1000-token vocabulary": (
            _gguf_variant(tiny_models, tmp, "small-embed.gguf", replace=small), "vocab"),
        "doubled hidden size": (_patch(base, "llama.embedding_length", 128), "shape"),
        "10^9 layers": (_patch(base, "llama.block_count", 10**9), "block_count"),
        "10^12 context": (_patch(base, "llama.context_length", 10**12), "context_length"),
        "truncated file": (cut, "offset"),
        "truncated header": (head_cut, ""),
        "string length past EOF": (_patch(base, "key length", 1 << 40, nth=3), "string length"),
        "negative array count": (_patch(base, "tokenizer.ggml.tokens count", -1), "tokenizer.ggml.tokens"),
        "huge array count": (_patch(base, "tokenizer.ggml.tokens count", 1 << 40), "tokenizer.ggml.tokens"),
        "huge tensor count": (_patch(base, "tensor_count", 1 << 62), "tensor_count"),
        "tensor offset past EOF": (_patch(base, "output_norm.weight offset", 1 << 33), "offset"),
        "unknown tensor type": (_patch(base, "blk.0.attn_q.weight type", 99), "type"),
        "zero alignment": (_gguf_alignment(tiny_models, tmp, 0), "general.alignment"),
    }


def _gguf_alignment(tiny_models, tmp, value: int) -> str:
    """The base file with a general.alignment key whose value is `value`."""
    import gguf
    path = str(tmp / f"align{value}.gguf")
    real = gguf.GGUFWriter.add_architecture

    def add_arch(self):  # the writer refuses a bad alignment itself: write 32, patch after
        real(self)
        self.add_uint32("general.alignment", 32)
    with mock.patch.object(gguf.GGUFWriter, "add_architecture", add_arch):
        write_gguf(tiny_models["llama"], path, Q.F32)
    return _patch(path, "general.alignment", value)


def test_each_named_kind_of_bad_gguf_is_refused_by_its_field(tiny_models, tmp_path):
    """The 15 GGUF cases the issue measured as mishandled (tracebacks, or files that
    loaded and served: 0 heads, a 100-row embedding for a larger vocabulary, a doubled
    hidden size) each end in one CheckpointError line naming the field."""
    for name, (path, field) in _explicit_gguf_cases(tiny_models, tmp_path).items():
        e = refused(load_all, path)
        assert e is not None, f"{name}: loaded"
        assert field in e.field, f"{name}: {e.field!r} / {e}"
        assert refused(validate_checkpoint, path) is not None, name


# ---- Hugging Face config.json --------------------------------------------------------

# config.json keys ferroxmp reads (loader.config_from_dict, limits.check_config, validate.py)
READ_FIELDS = {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
               "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
               "sliding_window", "use_sliding_window", "hidden_act", "torch_dtype", "dtype", "attention_bias",
               "bos_token_id", "pad_token_id", "eos_token_id", "use_cache", "mlp_bias"}
JSONISH = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 3, 10**9, 10**12, 2**63, -(2**63)]),
    st.integers(-10, 5000), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["float32", "bfloat16", "silu", "gelu", "llama3", "LlamaForCausalLM", "qwen2"]),
    st.lists(st.integers(0, 5), max_size=3), st.just({}), st.just({"rope_type": "llama3", "factor": 2.0}))


@pytest.fixture(scope="module")
def hf_base(tiny_models):
    folder = tiny_models[SHAPE]
    return Base({"folder": folder, "config": json.load(open(os.path.join(folder, "config.json")))})


def _int_edges(v):
    return st.sampled_from([0, -1, 1, v - 1, v + 1, v * 2, v // 2, 10**9, 10**12]) if isinstance(v, int) \
        and not isinstance(v, bool) else st.nothing()


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_mutated_config_json_is_refused_by_field_or_answers_like_transformers(hf_base, tmp_path_factory, data):
    """One config.json field (or a rope_scaling sub-field) replaced by an edge value of
    its own type or any JSON value, or deleted. Accepted configs must give transformers'
    greedy tokens on the same folder: a config that loads a wrong model fails here."""
    cfg = json.loads(json.dumps(hf_base["config"]))
    subkeys = ["rope_scaling." + k for k in cfg.get("rope_scaling") or {}]
    key = data.draw(st.sampled_from(sorted(cfg) + subkeys), label="key")
    target, name = (cfg["rope_scaling"], key.split(".", 1)[1]) if "." in key else (cfg, key)
    if data.draw(st.integers(0, 9), label="delete?") == 0:
        target.pop(name)
    else:
        target[name] = data.draw(st.one_of(_int_edges(target[name]), JSONISH), label="value")
    folder = os.path.join(tempfile.mkdtemp(dir=str(tmp_path_factory.getbasetemp())), "m")
    shutil.copytree(hf_base["folder"], folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if cfg == hf_base["config"] or refused(load_all, folder) is not None:
        return
    if load_config(folder).max_position_embeddings < len(PROMPT) + NEW:
        return  # the scheduler refuses a prompt longer than the context
    try:
        want = hf_greedy(folder)
    except Exception as e:  # noqa: BLE001 - the oracle itself refuses what ferroxmp accepted
        if key in READ_FIELDS or "." in key:
            pytest.fail(f"{key}={target.get(name)!r}: ferroxmp loads a config transformers refuses ({e!r})")
        # a field ferroxmp never reads (max_window_layers: null): its model is the one
        # without that field, which transformers builds
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({k: v for k, v in cfg.items() if k != key}, f)
        want = hf_greedy(folder)
    assert ferro_greedy(folder) == want, f"{key}={target.get(name)!r}"


def _hf_variant(src: str, dst: str, tensors=None, **config) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg.update(config)
    json.dump(cfg, open(path, "w"))
    if tensors is not None:
        w = load_file(os.path.join(dst, "model.safetensors"))
        w.update(tensors(w))
        save_file(w, os.path.join(dst, "model.safetensors"))
    return dst


def _explicit_hf_cases(tiny_models, tmp) -> dict[str, tuple[str, str]]:
    src = tiny_models["llama"]
    rows100 = lambda w: {k: w[k][:100].contiguous() for k in ("model.embed_tokens.weight", "lm_head.weight")}
    st_file = _hf_variant(src, str(tmp / "cut"))
    data = open(os.path.join(st_file, "model.safetensors"), "rb").read()
    with open(os.path.join(st_file, "model.safetensors"), "wb") as f:
        f.write(data[:-4096])
    return {
        "vocab 0": (_hf_variant(src, str(tmp / "v0"), vocab_size=0), "vocab_size"),
        "0 heads": (_hf_variant(src, str(tmp / "h0"), num_attention_heads=0), "num_attention_heads"),
        "embedding with 100 rows for a 1000-token vocabulary": (
            _hf_variant(src, str(tmp / "e100"), tensors=rows100), "weight shape"),
        "100-row embedding and vocab_size 100 under a 1000-token tokenizer": (
            _hf_variant(src, str(tmp / "v100"), tensors=rows100, vocab_size=100), "vocab_size"),
        "doubled hidden size": (_hf_variant(src, str(tmp / "h2"), hidden_size=128), "shape"),
        "10^9 layers": (_hf_variant(src, str(tmp / "l9"), num_hidden_layers=10**9), "num_hidden_layers"),
        "fewer layers than the file holds": (_hf_variant(src, str(tmp / "l1"), num_hidden_layers=1),
                                             "num_hidden_layers"),
        "10^12 context": (_hf_variant(src, str(tmp / "c12"), max_position_embeddings=10**12),
                          "max_position_embeddings"),
        "heads as a string": (_hf_variant(src, str(tmp / "hs"), num_attention_heads="4"), "num_attention_heads"),
        "llama3 rope with equal low and high factors": (_hf_variant(src, str(tmp / "r"), rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512}), "high_freq_factor"),
        "llama3 rope factor 1.7e-41 (the frequencies divided into inf: NaN logits)": (_hf_variant(
            src, str(tmp / "rf"), rope_scaling={"rope_type": "llama3", "factor": 1.7465107202841992e-41,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 512}), "factor"),
        "truncated safetensors": (st_file, "data_offsets"),
    }


def test_each_named_kind_of_bad_config_json_is_refused_by_its_field(tiny_models, tmp_path):
    """The Hugging Face cases: vocabulary 0 and 0 heads (loaded, then 500 on every
    request), a 100-row embedding (500 on most prompts), a doubled hidden size (wrong
    answers), 10^9 layers ('raise --kv-cache-gb'), and files that lie about their size."""
    for name, (path, field) in _explicit_hf_cases(tiny_models, tmp_path).items():
        e = refused(load_all, path)
        assert e is not None, f"{name}: loaded"
        assert field in e.field, f"{name}: {e.field!r} / {e}"


def test_a_benign_change_still_loads_and_answers_as_before(tiny_models, base_gguf, tmp_path):
    """The negative control: the validator is not refusing everything. A longer context
    in the GGUF and a different rope_theta in config.json both load; the first answers
    as the unmutated file, the second as transformers does on the same folder."""
    path = _patch(base_gguf["path"], "llama.context_length", 8192, fields=base_gguf["fields"])
    assert refused(load_all, path) is None
    assert ferro_greedy(path) == base_gguf["answer"]
    folder = _hf_variant(tiny_models["qwen2"], str(tmp_path / "theta"), rope_theta=12345.0)
    assert refused(load_all, folder) is None
    assert ferro_greedy(folder) == hf_greedy(folder)


# ---- ferroxmp serve --------------------------------------------------------------------

def test_serve_on_a_bad_checkpoint_exits_2_with_one_line_and_leaves_nothing(tiny_models, tmp_path):
    """`ferroxmp serve` on a truncated GGUF and on a folder whose embedding has 100 rows:
    exit code 2, one output line naming the file and the field, no process, socket
    directory or /dev/shm segment of that server left behind."""
    (tmp_path / "g").mkdir()
    (tmp_path / "h").mkdir()
    bad_gguf = _explicit_gguf_cases(tiny_models, tmp_path / "g")["truncated file"]
    bad_folder = _explicit_hf_cases(tiny_models, tmp_path / "h")["embedding with 100 rows for a 1000-token vocabulary"]
    for path, field in (bad_gguf, bad_folder):
        proc = subprocess.Popen([sys.executable, "-m", "ferroxmp.cli", "serve", "--model", path, "--port", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.strip()]
        assert proc.returncode == 2, out
        assert len(lines) == 1, out
        assert path in lines[0] and field in lines[0] and "expected" in lines[0], lines[0]
        assert not glob.glob(f"/dev/shm/fxmp_{proc.pid}_*")
        assert not glob.glob(os.path.join(tempfile.gettempdir(), f"ferroxmp-{proc.pid}-*"))



# ---- memory sizing ---------------------------------------------------------------------

def test_kv_sizing_failures_name_layers_context_kv_heads_head_dim_and_dtype_bytes(tiny_models, caplog):
    """A budget under two pages, and a pool the allocator refuses (ENOMEM), both say what
    was sized (2 x layers x tokens x kv heads x head_dim x bytes, with the product), not
    just 'raise --kv-cache-gb'; the product is checked against the config."""
    from ferroxmp.gpu_worker.kv.pool import KVPool, pages_for_budget
    cfg = load_config(tiny_models["llama"])
    per_context = 2 * cfg.num_layers * cfg.max_position_embeddings * cfg.num_kv_heads * cfg.head_dim * 4
    with pytest.raises(RuntimeError) as e:
        pages_for_budget(cfg, 16, None, 1e-9, 0.9, torch.device("cpu"))
    msg = str(e.value)
    assert (f"{cfg.num_layers} layers x {cfg.max_position_embeddings} tokens x {cfg.num_kv_heads} kv heads x "
            f"{cfg.head_dim} head_dim x 4 bytes = {per_context / 2**30:.3g} GiB") in msg, msg
    assert "kv-cache-gb" in msg
    with pytest.raises(RuntimeError) as e:  # 2**40 pages: the allocator refuses at once
        KVPool.for_model(cfg, 1 << 40, 16, torch.device("cpu"))
    msg = str(e.value)
    assert f"{cfg.num_layers} layers x {(1 << 40) * 16} tokens x {cfg.num_kv_heads} kv heads" in msg, msg
    assert "\n" not in msg
    per_page = per_context // cfg.max_position_embeddings * 16
    with caplog.at_level("WARNING", logger="ferroxmp.kv_pool"):  # 3 pages: serves, short of one context
        assert pages_for_budget(cfg, 16, None, 3 * per_page / 2**30, 0.9, torch.device("cpu")) == 3
    assert f"{cfg.max_position_embeddings} tokens x {cfg.num_kv_heads} kv heads" in caplog.text, caplog.text


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_pool_is_resident_only_where_written_and_refused_past_available_memory(tiny_models):
    """The CPU pool is an anonymous mapping: a 2 GiB pool costs (almost) no resident memory
    until pages are written, reads as zeros, grows by what is written, and a pool past the
    machine's MemAvailable is refused at start with its sizing (not killed under load)."""
    from ferroxmp.gpu_worker.kv.pool import KVPool, available_memory
    cfg = load_config(tiny_models["llama"])
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    pages = (2 << 30) // (per_token * 16)
    before = _resident_bytes()
    kv = KVPool.for_model(cfg, pages, 16, torch.device("cpu"), layout="hnd")
    assert kv.nbytes >= 1.9 * 2**30
    assert _resident_bytes() - before < 64 << 20, (_resident_bytes() - before) / 2**20
    assert not kv.k[:, :, -1000:].any() and not kv.v[:, :, :1000].any()  # zeros where never written
    written = 256 << 20  # a quarter GiB of pages, K and V
    n = written // per_token // 16
    for p in range(n):
        kv.fill_page(p, 1.5)
    grown = _resident_bytes() - before
    assert 0.9 * written < grown < written + (96 << 20), grown / 2**20
    assert float(kv.k[0, 0, 0, 0]) == 1.5 and not kv.k[:, :, n * 16:].any()
    kv.check_integrity()
    del kv
    avail = available_memory()
    assert avail is not None
    too_many = avail // (per_token * 16) + 16  # just past what the machine can hold
    with pytest.raises(RuntimeError) as e:
        KVPool.for_model(cfg, too_many, 16, torch.device("cpu"))
    assert "MemAvailable" in str(e.value) and f"{too_many * 16} tokens" in str(e.value), str(e.value)
