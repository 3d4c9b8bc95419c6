"""The Flask face: the extension, the HTTP adapter, the inspection endpoint, the operator page."""
