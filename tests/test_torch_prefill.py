"""The torch prefill backend against HuggingFace transformers on tiny checkpoints (CPU, fp32)."""
import pytest
import torch
import transformers

from trtllm_mk.backends.torch_prefill import TorchPrefill
from trtllm_mk.kv_cache import PagedKVCache
from trtllm_mk.model.checkpoint import load_checkpoint
from trtllm_mk.model.registry import resolve_model
from trtllm_mk.model.tiny import write_tiny_checkpoint


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_prefill_logits_and_cache_match_transformers(tmp_path, family):
    write_tiny_checkpoint(tmp_path, family=family, seed=4)
    spec = resolve_model(str(tmp_path)).spec
    w = {k: v.float() for k, v in load_checkpoint(tmp_path, spec).items()}
    cache = PagedKVCache.allocate(spec, 2, 128, 8, dtype=torch.float32, fill=1e4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (19, 7)]
    logits = TorchPrefill(spec, w).prefill(prompts, cache)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float()
    for b, p in enumerate(prompts):
        out = model(torch.tensor([p]), use_cache=True)
        ref = out.logits[0, -1]
        assert ((logits[b] - ref).norm() / ref.norm()).item() < 1e-4
        # the paged cache holds HF's (roped) keys and values for every prompt position
        k, v = cache.read(0, b, len(p))
        kv = out.past_key_values
        hf_k = kv.layers[0].keys if hasattr(kv, "layers") else kv[0][0]
        hf_v = kv.layers[0].values if hasattr(kv, "layers") else kv[0][1]
        assert torch.allclose(k, hf_k[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
        assert torch.allclose(v, hf_v[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
