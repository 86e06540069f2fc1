"""Generation backends: ``hf`` (Hugging Face generate and its speed code), ``vllm``, ``transformers_cb``
(``rollout/generation.py`` chooses one)."""
