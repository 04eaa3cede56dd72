"""`rollout serve`: an OpenAI-compatible HTTP server over the embedded engine.

protocol.py checks requests and shapes responses (OpenAI's wire format plus the `rollout`
extension: token ids, log-probs, policy version); server.py is the HTTP server
(standard library, threads, server-sent events); loading.py turns --config / --model /
--checkpoint into a loaded model behind an EngineService. See docs/serve.md.
"""
