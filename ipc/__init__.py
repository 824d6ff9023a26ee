"""fmserve wire protocol: msgspec messages, codecs and socket helpers shared by all processes."""
