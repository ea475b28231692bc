"""Processes the daemon runs beside itself, started and watched apart from
the server (the shape of uvicorn's ``supervisors/``)."""
