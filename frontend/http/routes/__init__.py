"""The route table, one module per face: each exposes `routes(app)` and returns its faces'
`Route`s, given the app's context (`context.AppContext`); `http/app.py` assembles them."""
