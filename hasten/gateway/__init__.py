"""hasten gateway: one OpenAI-compatible endpoint in front of many replicas.

Run it with ``hasten gateway --config gateway.yaml``; embed it with
:class:`hasten.gateway.core.Gateway` and :func:`hasten.gateway.app.serve`. See docs/gateway.md.
"""
