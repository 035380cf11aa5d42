"""A tiny, deterministic llama-architecture GGUF model for tests against real inference servers.

``write_tiny_gguf(path)`` writes about 600 KB: 2 layers, hidden size 64, 4 heads, F32 weights
drawn from a fixed seed, so the file is byte-identical on every run with the same ``gguf`` and
``numpy`` versions (tests/backends/install.sh pins both). Its vocabulary is SentencePiece-style
(tokenizer model "llama"): ``<unk>``, ``<s>``, ``</s>``, the ChatML markers ``<|im_start|>`` and
``<|im_end|>`` (control tokens), 256 byte-fallback tokens ``<0x00>``..``<0xFF>``, every printable
ASCII character as a piece (space is "▁"), and some whole words with the prefixes that let the
SPM tokenizer merge up to them. ``tokenizer.chat_template`` holds a ChatML Jinja template.

The output rows of the special and byte tokens are zero and the other rows are large, so their
logits are 0 while the best printable token scores far above: greedy (and ordinary temperature)
decoding only emits printable text and never emits ``</s>``, so generation always runs to
``max_tokens`` (finish_reason "length", Ollama's done_reason "length"). The text is gibberish;
tests assert on protocol and shapes, never on words.

Needs ``gguf`` and ``numpy`` (the llama backend's virtual environment has both, not the project's):

    $IOP_BACKENDS_DIR/llama/bin/python tests/backends/tiny_model.py OUT.gguf

The module itself imports neither at import time, so the project's tests may import its constants.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SEED = 20240611
N_LAYERS = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 128
N_CTX = 2048
# sha256 of the file written with gguf 0.19.0 and numpy 2.4.6 (install.sh's pins); a test may assert it.
SHA256 = "3aec6ac81c5c952f01900606965b8d71240ad39d670732db3595ff51cea69f1c"

# Jinja (llama.cpp, llama-cpp-python) and Go (Ollama Modelfile TEMPLATE) spellings of one ChatML format.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
OLLAMA_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)

_WORDS = (
    "the of and to in is that it for was on are as with be at by this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called "
    "just where most know hello world model token stream node edge"
)
WORDS = tuple(_WORDS.split())

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (gguf.TokenType values) in id order."""
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [unknown, control, control, control, control]
    scores = [0.0] * len(tokens)
    for value in range(256):
        tokens.append(f"<0x{value:02X}>")
        types.append(byte)
        scores.append(0.0)
    pieces = [SPACE] + [chr(code) for code in range(0x21, 0x7F)]
    seen = set(pieces)
    for word in WORDS:
        for end in range(2, len(word) + 2):
            piece = SPACE + word[: end - 1]
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    for piece in pieces:
        tokens.append(piece)
        types.append(normal)
        # SPM merges the pair whose merged piece scores highest first: prefer longer pieces.
        scores.append(float(len(piece)) - 100.0)
    return tokens, scores, types


def _add_metadata(writer: Any, gguf: Any, tokens: list[str], scores: list[float], types: list[int]) -> None:
    writer.add_name("iop-tiny-llama")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(value=True)
    writer.add_add_eos_token(value=False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_tensors(writer: Any, np: Any, types: list[int]) -> None:
    """F32 weights from one seeded generator, drawn in a fixed order."""
    n_vocab = len(types)
    head_dim = N_EMBD // N_HEAD
    rng = np.random.Generator(np.random.PCG64(SEED))

    def weights(rows: int, cols: int, std: float) -> Any:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD, 1.0))
    for layer in range(N_LAYERS):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones.copy())
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(N_HEAD * head_dim, N_EMBD, 0.125))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(N_HEAD_KV * head_dim, N_EMBD, 0.125))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(N_HEAD_KV * head_dim, N_EMBD, 0.125))
        writer.add_tensor(f"{prefix}.attn_output.weight", weights(N_EMBD, N_HEAD * head_dim, 0.125))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones.copy())
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(N_FF, N_EMBD, 0.125))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(N_FF, N_EMBD, 0.125))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(N_EMBD, N_FF, 0.125))
    writer.add_tensor("output_norm.weight", ones.copy())
    # Logits of about +-16: the zero rows (special and byte tokens) never win, even when sampled at temperature 1.
    output = weights(n_vocab, N_EMBD, 2.0)
    printable = np.array([kind == 1 for kind in types])
    output[~printable] = 0.0
    writer.add_tensor("output.weight", output)


def write_tiny_gguf(path: Path) -> Path:
    """Write the tiny model to ``path`` (parents created) and return ``path``."""
    import gguf
    import numpy as np

    tokens, scores, types = vocabulary()
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(writer, gguf, tokens, scores, types)
    _add_tensors(writer, np, types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.gguf", file=sys.stderr)
        return 2
    out = write_tiny_gguf(Path(argv[1]).resolve())
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
