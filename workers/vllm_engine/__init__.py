"""vLLM as a worker's engine (`run_worker --engine vllm`), behind `workers.engine.api.InferenceEngine`.

`prompt` (pure) builds vLLM's prompt from the router's token view and checks vLLM's layout
against the router's block hashes; `engine` hosts vLLM's AsyncLLM and imports vLLM, so only the
vLLM virtualenv (`make vllm`) imports it.
"""
