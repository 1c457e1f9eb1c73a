/// @file
/// Whether the route record's code is built with zstd, and the inline namespace that keeps the two
/// builds apart. A program may link translation units built with and without
/// ROUTING_REPLAY_WITH_ZSTD (the routing_replay::zstd CMake target defines it): every entity of the
/// record then has a different mangled name in each, so the linker never merges an inline function
/// that can decompress with one that cannot (which would break the one-definition rule silently).
#pragma once

#if defined(ROUTING_REPLAY_WITH_ZSTD) && ROUTING_REPLAY_WITH_ZSTD
/// @brief 1 where the zstd codecs are compiled in (libzstd linked), 0 where they are not.
#define ROUTING_REPLAY_WIRE_HAS_ZSTD 1
#define ROUTING_REPLAY_WIRE_ABI_BEGIN inline namespace with_zstd {
#else
#define ROUTING_REPLAY_WIRE_HAS_ZSTD 0
#define ROUTING_REPLAY_WIRE_ABI_BEGIN inline namespace without_zstd {
#endif
#define ROUTING_REPLAY_WIRE_ABI_END }
