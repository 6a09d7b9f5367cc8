"""Object store URLs: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``.

A URL names a bucket (an Azure container) and a key prefix in it; a model's files are the
objects under the prefix, each named by its key relative to it, as a mirror folder's
files are by their paths. What is printed back of a URL never carries a secret: user
information and query strings (a presigned URL's signature, a SAS token) are removed
(:func:`redact`).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from loaderplug.errors import SettingsError

# The schemes loaderplug reads, and the store each names (IOPolicy.fs_type).
STORE_OF_SCHEME = {"s3": "s3", "gs": "gcs", "az": "azure"}
_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<rest>.*)$", re.DOTALL)
# Secrets a URL can carry: user:password@ before the host, and a query string.
# Up to the last "@" of the URL: a secret key may itself hold "/" (AWS's often do).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"]*@")
_QUERY = re.compile(r"(?P<url>[A-Za-z][A-Za-z0-9+.-]*://[^\s?'\"]*)\?[^\s'\"]*")
# A bucket name as every store allows it (S3's rule, the strictest of the three).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_object_url(text: str | object) -> bool:
    """Whether ``text`` is a URL (``scheme://...``) rather than a path."""
    return isinstance(text, str) and _URL.match(text) is not None


def redact(text: str) -> str:
    """``text`` with any URL's user information and query string removed."""
    return _QUERY.sub(r"\g<url>?…", _USERINFO.sub(r"\g<scheme>…@", text))


@dataclass(frozen=True)
class ObjectURL:
    """A bucket and a key prefix in it (``""``: the whole bucket), with no ``/`` at
    either end of the prefix."""

    scheme: str
    bucket: str
    prefix: str

    @staticmethod
    def parse(text: str, *, variable: str = "url") -> ObjectURL:
        """The URL ``text`` names; a clear :class:`SettingsError` (naming ``variable``)
        for an unknown scheme, a missing or malformed bucket, a secret in it, or a key
        that is not a plain relative path."""
        match = _URL.match(text)
        if match is None:
            raise _bad(variable, text, "is not a URL (scheme://bucket/prefix)")
        scheme, rest = match["scheme"].lower(), match["rest"]
        if scheme not in STORE_OF_SCHEME:
            known = ", ".join(f"{s}://" for s in STORE_OF_SCHEME)
            raise _bad(
                variable, text, f"names the unknown scheme {scheme}://; loaderplug reads {known}"
            )
        if "?" in rest or "#" in rest or "@" in rest:
            raise _bad(
                variable,
                text,
                "carries credentials or a query; set them in the environment (AWS_*, "
                "GOOGLE_APPLICATION_CREDENTIALS, AZURE_*), not in the URL",
            )
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise _bad(variable, text, f"has no valid bucket name ({bucket!r})")
        prefix = prefix.strip("/")
        problem = key_problem(prefix) if prefix else ""
        if problem:
            raise _bad(variable, text, problem)
        return ObjectURL(scheme, bucket, prefix)

    @property
    def store(self) -> str:
        """The store's kind: ``s3``, ``gcs`` or ``azure``."""
        return STORE_OF_SCHEME[self.scheme]

    @property
    def root(self) -> ObjectURL:
        """The bucket itself."""
        return ObjectURL(self.scheme, self.bucket, "")

    @property
    def name(self) -> str:
        """The last part of the prefix (a model file's name), or the bucket's."""
        return posixpath.basename(self.prefix) or self.bucket

    def key(self, rel: str = "") -> str:
        """The key of ``rel`` under the prefix."""
        return posixpath.join(self.prefix, rel) if self.prefix and rel else self.prefix or rel

    def child(self, rel: str) -> ObjectURL:
        """The URL of ``rel`` under the prefix."""
        return ObjectURL(self.scheme, self.bucket, self.key(rel))

    def parent(self) -> ObjectURL:
        return ObjectURL(self.scheme, self.bucket, posixpath.dirname(self.prefix))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


def _bad(variable: str, text: str, problem: str) -> SettingsError:
    shown = redact(text)
    return SettingsError(
        variable,
        shown,
        "an object store URL: s3://, gs:// or az://bucket/prefix",
        message=f"{variable}={shown!r} {problem}",
    )


def key_problem(key: str) -> str:
    """Why ``key`` cannot name a file of a model ('' if it can): every part a plain
    name, so a key can never place a file outside its destination."""
    if key.startswith("/") or "\\" in key or "\0" in key:
        return f"the key {key!r} is not a plain relative path"
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return f"the key {key!r} has an empty, '.' or '..' part and is refused"
    return ""
