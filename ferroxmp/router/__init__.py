"""`ferroxmp router`: one OpenAI-compatible address in front of several ferroxmp servers.

tree.py (what was sent where), policy.py (which backend gets a request),
backends.py (health and load polling), upstream.py (one proxied HTTP exchange),
app.py (the Flask routes), server.py (flags, waitress, lifecycle).
"""
