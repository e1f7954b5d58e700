"""The browser pages a frontend serves (issue 55): the playground at `/` and the live
dashboard at `/dashboard`, plain ES modules and CSS from this package (no build step, no
network). `frontend/http/routes/web.py` serves them."""
