"""tqserve replicas on Ray Serve (`pip install 'tqserve[ray]'`, `tqserve ray-serve`):
guest.py runs trio inside a replica's asyncio loop and bridges ASGI calls into it;
deployment.py is the Ray Serve deployment; cli.py starts or joins a Ray cluster."""
