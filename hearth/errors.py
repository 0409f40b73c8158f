"""The errors hearth raises on bad input; the CLI prints them without a traceback."""


class HearthError(Exception):
    """Base of every error that is the user's input, not a bug."""


class ModelLoadError(HearthError):
    """A model file or folder that cannot be loaded: the message names what and where."""


class RequestError(HearthError, ValueError):
    """A request the engine cannot take (prompt too long, bad parameter)."""


# how a model without a vision encoder refuses images (the engine's RequestError, the server's 400)
NO_IMAGES = "this model takes no images"
