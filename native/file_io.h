// Reading the model files at offsets: POSIX open and pread, or Windows' CreateFileW and ReadFile at an
// offset. Each read names its offset, so the threads of several decisions may read one file at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace clef {

using FileHandle = intptr_t;  // a file descriptor, or a Windows HANDLE
constexpr FileHandle NO_FILE = -1;  // (INVALID_HANDLE_VALUE too)

// Open `path` (UTF-8 on Windows: Python's os.fsencode) to read; throws Error naming it.
FileHandle open_file(const std::string & path);
void close_file(FileHandle file);
// Exactly `size` bytes at `offset`, or Error.
void read_at(FileHandle file, void * dst, size_t size, uint64_t offset);

// A model file: an open file, or its bytes in memory that the caller keeps, unchanged, while the head lives (a
// runtime's private copy of what it reads of a base after load: no other process can change or truncate it).
struct Source {
    FileHandle file = NO_FILE;
    const uint8_t * data = nullptr;
    uint64_t size = 0;
};
void read_at(const Source & source, void * dst, size_t size, uint64_t offset);

}  // namespace clef
