"""The quality guard for a vLLM-served model: a proxy in front of `vllm serve`'s OpenAI API that checks a sampled
share of answers against the full-depth model, as the shim's shadow check does (docs/vllm.md, "Quality guard").
Torch-free: it runs beside vLLM as the exporter does."""
