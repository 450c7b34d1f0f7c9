"""What every request of the OpenAI port passes on its way in and out: the key, CORS, the
request id, admission, drain, metrics, the access log."""
