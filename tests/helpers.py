"""Shared builders for the equivalence tests: tiny random-weight models and tier configs."""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

VOCAB = 256
BLOCK_SIZE = 4


def tiny_model(arch: str):
    torch.manual_seed(1234)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif arch in WINDOWED_ARCHS:
        model = windowed_model(arch, common)
    else:
        raise ValueError(arch)
    model.eval()
    # random weights emit EOS at random; keep every run the full length so turns are comparable
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# sliding-window and hybrid families (issue 18), window SLIDING_WINDOW tokens:
#   mistral_sw  every layer sliding;   qwen2_sw  max_window_layers: 2 full then 2 sliding
#   gemma3      5 sliding : 1 full;    cohere2   3 sliding : 1 full
WINDOWED_ARCHS = ("mistral_sw", "qwen2_sw", "gemma3", "cohere2")
SLIDING_WINDOW = 10


def windowed_model(arch: str, common: dict):
    from transformers import Cohere2Config, Cohere2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    window = SLIDING_WINDOW
    if arch == "mistral_sw":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=window))
    if arch == "qwen2_sw":
        return Qwen2ForCausalLM(Qwen2Config(**{**common, "num_hidden_layers": 4}, use_sliding_window=True,
                                            sliding_window=window, max_window_layers=2))
    if arch == "gemma3":
        return Gemma3ForCausalLM(Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=16,
                                                  sliding_window=window, query_pre_attn_scalar=16))
    if arch == "cohere2":
        return Cohere2ForCausalLM(Cohere2Config(**{**common, "num_hidden_layers": 4}, sliding_window=window))
    raise ValueError(arch)


def tier_config(kind: str, cold_dir, block_size: int = BLOCK_SIZE, engine: str = "auto", delay_us: int = 0,
                warm_layout: str | None = None) -> dict:
    """all_hot: everything fits in hot. forces_warm: hot smaller than one turn.
    forces_cold: hot+warm smaller than the conversation. `engine` "thread" runs every copy later,
    on the asynchronous CPU copy engine (after `delay_us` each): the GPU's ordering rules on CPU;
    with it warm keeps a GPU store's layout too (records), unless `warm_layout` says otherwise
    (the default engine gets the CPU's: paged, read in place)."""
    sizes = {
        "all_hot": (256, 0, 0),
        "forces_warm": (2, 256, 0),
        "forces_cold": (2, 3, 256),
    }[kind]
    return {
        "block_size": block_size,
        "hot": {"device": "cpu", "capacity_blocks": sizes[0]},
        "warm": {"capacity_blocks": sizes[1],
                 "layout": warm_layout or ("records" if engine == "thread" else "auto")},
        "cold": {"capacity_blocks": sizes[2], "path": str(cold_dir)},
        "copies": {"engine": engine, **({"delay_us": delay_us} if engine == "thread" else {})},
    }


TIER_KINDS = ("all_hot", "forces_warm", "forces_cold")
# (engine, delay_us): copies at once, and copies held back on the thread engine (issue 16)
ENGINES = (("auto", 0), ("thread", 300))
ENGINE_IDS = ("sync", "thread300us")


# ---- shared by the issue-5 tests (verified history, threads, atomic steps, deepcopy, close) ----

FORMS = ("model", "config")  # CacheBank(model, ...) sees every computed id; CacheBank(model.config, ...) does not


def rand_ids(seed: int, length: int) -> torch.Tensor:
    """`[1, length]` random token ids (never the pad id 0)."""
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def same_shape_model(model, seed: int):
    """A model with `model`'s exact config (so the same KV shape) and different random weights."""
    torch.manual_seed(seed)
    other = type(model)(type(model.config).from_dict(model.config.to_dict()))
    other.eval()
    other.generation_config.eos_token_id = None
    other.generation_config.pad_token_id = 0
    return other


def make_bank(form: str, model, config=None, **kwargs):
    """A CacheBank built from the model itself ("model") or from its config only ("config")."""
    import tiered_kv

    return tiered_kv.CacheBank(model if form == "model" else model.config, config, **kwargs)


def greedy(model, ids: torch.Tensor, cache, max_new_tokens: int) -> torch.Tensor:
    return model.generate(ids, cache=cache, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False)


def reference(model, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The same generate() through a fresh transformers DynamicCache."""
    from transformers import DynamicCache

    return greedy(model, ids, DynamicCache(config=model.config), max_new_tokens)


def flip_cold_byte(store, block_id: int, byte_offset: int) -> None:
    """Corrupt one byte of a cold block's record on disk, as bit rot would (the one place tests
    reach into where a block's record lies)."""
    import os

    cold = store.tiers[2]
    with open(cold.file_path, "r+b") as f:
        offset = store.index.get(block_id).slot * cold.record_stride_bytes + byte_offset
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


# ---- shared by the issue-6 store-level fault tests (crash recovery) ----------------------------

def published_chain(store, model, ids) -> list[int]:
    """Block ids the store holds, published under `model`'s chain keys for the leading full blocks
    of `ids` (`[1, n]`), in token order, up to the first block it does not hold. Retains nothing."""
    from tiered_kv.identity import ModelFingerprint, chain_keys

    block_size = store.config.block_size
    root = ModelFingerprint.of(model, block_size).root_key(store.layout.dtype_name)
    token_ids = [int(x) for x in ids[0].tolist()]
    found = []
    for key in chain_keys(root, token_ids, block_size, 0, len(token_ids) // block_size):
        block_id = store.index.lookup(key)
        if block_id is None:
            break
        found.append(block_id)
    return found


def mount_tmpfs(path, size: str):
    """Mount a tmpfs of `size` at `path` (created 0700). Returns None when mounted, else why not
    (not root, no mount(8), refused); the caller umounts with `umount_tmpfs`."""
    import os
    import subprocess

    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip() or done.returncode}"


def umount_tmpfs(path) -> None:
    import subprocess

    subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: detaches even with files open


def linear_attention_model():
    """A tiny Qwen3-Next (gated delta-net layers beside full attention): a layer kind no bank serves."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(7)
    return Qwen3NextForCausalLM(Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=16, num_experts=2, num_experts_per_tok=1,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                linear_num_value_heads=2, linear_num_key_heads=2,
                                                linear_key_head_dim=16, linear_value_head_dim=16)).eval()
