"""The errors hearth raises on bad input; the CLI prints them without a traceback."""


class HearthError(Exception):
    """Base of every error that is the user's input, not a bug."""


class ModelLoadError(HearthError):
    """A model file or folder that cannot be loaded: the message names what and where."""


class RequestError(HearthError, ValueError):
    """A request the engine cannot take (prompt too long, bad parameter)."""


# the async engine's (hearth/engine/async_engine.py), here so that what only answers with them (the
# server's error handlers, a router in front of replicas) need not import the engine, nor torch
class QueueFull(HearthError):
    """More requests are waiting than max_queue allows (HTTP 503)."""


class EngineStopped(HearthError):
    """The engine is shut down, or its thread died; the request cannot go on (HTTP 503)."""


class RequestFailed(HearthError):
    """The engine step that ran this request raised; the request was aborted (HTTP 500)."""


# how a model without a vision encoder refuses images (the engine's RequestError, the server's 400)
NO_IMAGES = "this model takes no images"
