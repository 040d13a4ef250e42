"""A GGUF file's tokenizer metadata as a `tokenizers.Tokenizer`, special tokens and
chat template: what the frontend would read from tokenizer.json and tokenizer_config.json.

Job: byte-level BPE (`tokenizer.ggml.model` = 'gpt2'): vocab from `tokens`, merges
from `merges`, the pre-tokenizer from `tokenizer.ggml.pre` (llama.cpp's name for the
split regex its converter recognised), added tokens from `token_type` (CONTROL ->
special, USER_DEFINED -> plain added token), BOS/EOS from their ids, BOS/EOS
insertion from `add_bos_token` / `add_eos_token`.

Invariants: the pipeline for each `pre` is the one the model's own tokenizer.json
carries (so ids equal the Hugging Face tokenizer's); an unknown tokenizer model or
pre-tokenizer is refused by name, never guessed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .gguf_config import GGUFUnsupported
from .gguf_file import GGUFFile

if TYPE_CHECKING:
    from tokenizers import Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> pipeline family (names as llama.cpp's converter writes them)
PRE_TOKENIZERS = {
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3", "pixtral": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva-7b": "digits",
    "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
}
# Texts llama.cpp also treats as end of generation when the file marks them CONTROL.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id", "sep_token": "seperator_token_id",
                "cls_token": "cls_token_id", "mask_token": "mask_token_id"}


def _pipeline(tok: Tokenizer, family: str) -> None:
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if family == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False), byte_level])
    elif family == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated", invert=False), byte_level])
    elif family == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()


def _token(g: GGUFFile, key: str) -> Optional[str]:
    i = g.get("tokenizer.ggml." + key)
    tokens = g.get("tokenizer.ggml.tokens") or []
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def special_tokens(g: GGUFFile) -> dict[str, str]:
    """bos_token, eos_token, ... as their texts (what a chat template reads)."""
    return {name: t for name, key in _SPECIAL_IDS.items() if (t := _token(g, key)) is not None}


def chat_template(g: GGUFFile) -> Optional[str]:
    t = g.get("tokenizer.chat_template")
    return t if isinstance(t, str) else None


def eog_token_ids(g: GGUFFile) -> list[int]:
    """End-of-generation ids as llama.cpp sees them: eos, eot, eom, then the CONTROL
    tokens whose text marks an end (<|im_end|>, <|endoftext|>, ...)."""
    ids = [g.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = g.get("tokenizer.ggml.tokens") or [], g.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids if isinstance(i, int)))


def build_tokenizer(g: GGUFFile) -> Tokenizer:
    # tokenizers imported here, not at the top: the worker reads only the end-of-generation
    # ids (eog_token_ids) and need not load the library (~5 MB resident, 0.1 s)
    from tokenizers import AddedToken, Tokenizer, models
    kind, pre = g.get("tokenizer.ggml.model"), g.get("tokenizer.ggml.pre", "default")
    if kind is None or not g.get("tokenizer.ggml.tokens"):
        raise GGUFUnsupported(f"{g.path}: the file carries no tokenizer (tokenizer.ggml.model / tokens); "
                              "ferroxmp needs the tokenizer in the GGUF metadata")
    if kind != "gpt2":
        raise GGUFUnsupported(f"{g.path}: tokenizer model {kind!r} is not supported; ferroxmp reads "
                              "byte-level BPE GGUF tokenizers (tokenizer.ggml.model = 'gpt2')")
    if pre not in PRE_TOKENIZERS:
        raise GGUFUnsupported(f"{g.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                              f"ferroxmp knows {', '.join(sorted(PRE_TOKENIZERS))}")
    tokens, types = g.get("tokenizer.ggml.tokens"), g.get("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
    family = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               ignore_merges=family == "llama3"))
    _pipeline(tok, family)
    pairs = list(zip(tokens, types or []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == USER_DEFINED])
    _edges(tok, g)
    return tok


def _edges(tok: Tokenizer, g: GGUFFile) -> None:
    """BOS before / EOS after each sequence when the file asks for it (add_special_tokens)."""
    from tokenizers import processors
    ends = {}
    for edge in ("bos", "eos"):
        i = g.get(f"tokenizer.ggml.{edge}_token_id")
        if g.get(f"tokenizer.ggml.add_{edge}_token") and isinstance(i, int):
            ends[edge] = (g.get("tokenizer.ggml.tokens")[i], i)
    if not ends:
        return
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    single = bos + ["$A"] + eos
    pair = single + [t + ":1" for t in bos] + ["$B:1"] + [t + ":1" for t in eos]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                       special_tokens=list(ends.values()))
