"""The algorithm without a network: the config and its hash, models (byte GPT, Hugging Face), data sources and
tokenizers, fragments and their schedule, the inner AdamW, the outer step and merges, codec maths, devices, typed
events, fault points. torch only: no hivemind, so the maths is tested without a network stack."""
