"""`fmserve top`: the Textual monitor (`app.TopApp`). Depends on `ipc` only (never `service` or `gpu`)."""
