"""What ``tokenize`` reports to its user: a failure as one line, a stop by a signal with its exit status."""


class TokenizeError(Exception):
    """A failure the user can act on, reported as one line."""

    exit_code = 1


class Stopped(TokenizeError):
    """SIGTERM or SIGINT: workers stopped, finished units kept."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def one_line(error: BaseException) -> str:
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(message).split()) or type(error).__name__
