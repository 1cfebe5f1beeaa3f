// How libclef_head exports its C API: __declspec on Windows (MSVC and MinGW; CMakeLists.txt defines
// CLEF_HEAD_BUILD while building the library), default visibility elsewhere (GCC and Clang, whose
// other symbols are hidden: CXX_VISIBILITY_PRESET).
#pragma once

#if defined(_WIN32)
#if defined(CLEF_HEAD_BUILD)
#define CLEF_EXPORT __declspec(dllexport)
#else
#define CLEF_EXPORT __declspec(dllimport)
#endif
#else
#define CLEF_EXPORT __attribute__((visibility("default")))
#endif
