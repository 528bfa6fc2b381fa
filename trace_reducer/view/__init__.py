"""What a person reads: the self-contained HTML page of a bundle and the live `watch`."""

from ._view import VIEW_FILE_NAME, write_view
from ._watch import WatchUpdate, follow_bundle

__all__ = ["VIEW_FILE_NAME", "WatchUpdate", "follow_bundle", "write_view"]
