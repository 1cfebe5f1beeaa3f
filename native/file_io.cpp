// See file_io.h.
#include "file_io.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "head.h"

#ifdef _WIN32
#ifndef NOMINMAX
#define NOMINMAX
#endif
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#else
#include <fcntl.h>
#include <unistd.h>
#endif

namespace clef {

#ifdef _WIN32

namespace {

std::string system_message(DWORD code) {
    char text[512];
    DWORD n = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, nullptr, code, 0, text, sizeof text, nullptr);
    while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == '.')) n--;
    return n > 0 ? std::string(text, n) : "Windows error " + std::to_string(code);
}

}  // namespace

FileHandle open_file(const std::string & path) {
    const int n = MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path.c_str(), -1, nullptr, 0);
    if (n <= 0) throw Error("cannot open " + path + ": the path is not UTF-8");
    std::wstring wide((size_t) n, L'\0');
    MultiByteToWideChar(CP_UTF8, MB_ERR_INVALID_CHARS, path.c_str(), -1, &wide[0], n);
    // Shared as a POSIX descriptor is: another process may read, replace or delete the file meanwhile.
    HANDLE h = CreateFileW(wide.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE, nullptr,
                           OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
    if (h == INVALID_HANDLE_VALUE) throw Error("cannot open " + path + ": " + system_message(GetLastError()));
    return (FileHandle) h;
}

void close_file(FileHandle file) {
    if (file != NO_FILE) CloseHandle((HANDLE) file);
}

void read_at(FileHandle file, void * dst, size_t size, uint64_t offset) {
    auto * out = static_cast<uint8_t *>(dst);
    while (size > 0) {
        OVERLAPPED at = {};  // on a handle opened without FILE_FLAG_OVERLAPPED: a plain read at this offset
        at.Offset = (DWORD) offset;
        at.OffsetHigh = (DWORD) (offset >> 32);
        DWORD got = 0;
        if (!ReadFile((HANDLE) file, out, (DWORD) std::min<size_t>(size, 1u << 30), &got, &at)) {
            const DWORD code = GetLastError();
            if (code != ERROR_HANDLE_EOF) throw Error("cannot read the model file: " + system_message(code));
        }
        if (got == 0) throw Error("cannot read the model file: unexpected end of file");
        out += got;
        size -= got;
        offset += got;
    }
}

#else

FileHandle open_file(const std::string & path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
    return fd;
}

void close_file(FileHandle file) {
    if (file != NO_FILE) close((int) file);
}

void read_at(FileHandle file, void * dst, size_t size, uint64_t offset) {
    auto * out = static_cast<uint8_t *>(dst);
    while (size > 0) {
        ssize_t n = pread((int) file, out, size, (off_t) offset);
        if (n <= 0) {
            throw Error(std::string("cannot read the model file: ") + (n < 0 ? std::strerror(errno) : "unexpected end of file"));
        }
        out += n;
        size -= (size_t) n;
        offset += (uint64_t) n;
    }
}

#endif

void read_at(const Source & source, void * dst, size_t size, uint64_t offset) {
    if (source.data == nullptr) return read_at(source.file, dst, size, offset);
    if (offset > source.size || size > source.size - offset) throw Error("cannot read the model file: unexpected end of file");
    std::memcpy(dst, source.data + offset, size);
}

}  // namespace clef
