"""What every route shares: the bridge to the engine process and its per-request streams,
a request's jobs, the error shape, app state, middleware, OpenAPI, weight uploads and the
co-located trainer as the front end sees it."""
