"""Entry points above the scheduler: the offline Engine, the request builder and the HTTP server."""
