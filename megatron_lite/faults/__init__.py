"""Fault handling: `stop` turns SIGUSR1/SIGTERM into a stop at the next step boundary; `stalls` names the rank
a stalled collective waited for and tells a collective's timeout from any other error."""
