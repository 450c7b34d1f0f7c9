"""What every HTTP listener of ours (the control socket, the OpenAI port, /metrics) lets a
connection hold: the cap, the deadlines, a bounded head and body, and a flood logged as
a count."""
