"""The Hugging Face integration (`client/hf.py`), measured: TTFT with a cached prefix."""
