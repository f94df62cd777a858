"""vllm_lite.worker"""
