"""Host-device plumbing shared by the engine and the proposers: pinned staging of
host-to-device and device-to-host copies (staging.py) and CUDA graph capture
(graph_capture.py). Torch and numpy only; nothing here imports another specdec package."""
