"""CacheBlend on Hugging Face models, measured: quality, TTFT, attention kernels; its trained model."""
