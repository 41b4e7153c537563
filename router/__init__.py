"""The OpenAI gateway: handlers, request features, pure routing policies, prefix index, proxy.
Never imports `autoscaler` or `providers`. Built in the router issue."""
