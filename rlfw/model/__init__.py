"""The model as every part sees it: its shape (``shape``), and Hugging Face names and files (``hf_convert``,
``hf_checkpoint``); below both the trainer (``rlfw.megatron``) and the engines (``rlfw.rollout``)."""
