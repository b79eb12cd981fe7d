"""The one error the export package raises: it names what is wrong and where."""


class ExportError(ValueError):
    """A source, destination, file or configuration cannot be exported or loaded as asked."""
