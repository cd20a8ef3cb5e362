"""The peer of ddtree.profiling.real_width: the same shape as transformers' own Qwen3ForCausalLM (sdpa),
timed as `generate` with a static cache (eager, and optionally with its forward compiled) and as one decode
step captured as a CUDA graph where the capture works. RANDOM WEIGHTS: only the timings mean something.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

import torch

from ddtree.profiling.kernel_profile import Replay, free_memory, sync_device
from ddtree.profiling.random_models import shape_of


def peer_part(shape: str, device: torch.device, dtype: torch.dtype, context: int, steps: int = 32,
              compiled: bool = False) -> dict[str, Any]:
    """transformers' Qwen3ForCausalLM of the same shape (random weights, sdpa): ms per decode step at batch 1,
    by generate with a static cache (eager; with `compiled` also with the forward torch.compiled, as
    transformers does by default for a static cache on CUDA), and as one captured decode step where the
    capture works."""
    out: dict[str, Any] = {}
    try:
        import transformers
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError as err:
        return {"error": f"transformers is not installed: {err}"}
    s = shape_of(shape)
    vocab = s.vocab if s.vocab is not None else 4096
    out["transformers"] = transformers.__version__
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, max_position_embeddings=max(s.max_context, context + 2 * steps + 64),
                      tie_word_embeddings=True, attn_implementation="sdpa")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            held = [Qwen3ForCausalLM(cfg).eval()]
    finally:
        torch.set_default_dtype(default)
    model = held[0]
    prompt = torch.randint(0, vocab, (1, context), device=device)

    def gen(n: int, compile_forward: bool) -> float:
        sync_device(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=0, disable_compile=not compile_forward)
        sync_device(device)
        return time.perf_counter() - t0

    for label, compile_forward in [("eager", False), *([("compiled", True)] if compiled else [])]:
        try:
            gen(4, compile_forward)  # warm-up (and the compile)
            short = statistics.median(gen(4, compile_forward) for _ in range(3))
            long = statistics.median(gen(4 + steps, compile_forward) for _ in range(3))
            out[f"generate_static_{label}_ms"] = 1000 * (long - short) / steps
            print(f"  peer generate (static cache, {label}): {out[f'generate_static_{label}_ms']:.3f} ms/step",
                  flush=True)
        except Exception as err:
            out[f"generate_{label}_error"] = repr(err)[:400]
    try:
        out["graph_step_ms"] = _peer_graph_step(model, cfg, prompt, device, context)
        print(f"  peer decode step as a CUDA graph: {out['graph_step_ms']:.3f} ms", flush=True)
    except Exception as err:
        out["graph_error"] = repr(err)[:400]
        print(f"  peer graph step failed: {out['graph_error']}", flush=True)
    held.clear()
    free_memory(device)
    return out


def _peer_graph_step(model, cfg, prompt: torch.Tensor, device: torch.device, context: int) -> float:
    from transformers import StaticCache

    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    cache = StaticCache(config=cfg, max_cache_len=context + 64)
    params = inspect.signature(model.model.forward).parameters
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        ids = prompt[:, -1:].clone()
        pos = torch.full((1, 1), context, dtype=torch.long, device=device)
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": pos, "past_key_values": cache, "use_cache": True}
        if "cache_position" in params:
            kwargs["cache_position"] = pos[0]
        replay = Replay(lambda: model(**kwargs).logits, device)
        return replay.time()
