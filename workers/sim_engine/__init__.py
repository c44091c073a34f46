"""The simulated engine (`run_worker --engine sim`), the analogue of Dynamo's mocker: no model, no
torch. It serves real tasks from the real queues with the native engine's own scheduler
(`workers.scheduler`) over a real paged prefix pool (`workers.kv_cache.KvPool`, keyed by the
router's block hashes, publishing real KV events), and takes each step's time from a timing
model (`profile`) instead of a forward pass.

`profile` (the timing model and its files under `profiles/`), `clock` (the clock many engines of
one process share: scaled real time, or virtual time for replays), `engine` (`SimEngine`, an
`InferenceEngine`), `fleet` (many simulated workers in one process).
"""
