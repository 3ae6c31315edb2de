"""Model facts and model building.

    registry.py  per architecture (Llama, Mistral, Qwen2, Qwen3, SmolLM3): what transformers does not ship (biases,
                 attention-mask kinds), the TP split read from its base_model_tp_plan; `facts_for` refuses others
    shape.py     exact parameter counts and activation bytes from a config (planner, FLOPs)
    loss.py      the causal-LM loss conventions: ignore index, label shift, token-sum cross-entropy
    presets.py   preset configs (tiny models of every architecture, real Llama shapes) and config loading
    build.py     building the model a run trains: on the meta device, materialised shard by shard, ZeRO-3's
    init.py      the seeded init of a preset (and LoRA adapters), identical in every layout
    load.py      weights into the local shards: a checkpoint's safetensors or the seeded init, through DCP
"""
