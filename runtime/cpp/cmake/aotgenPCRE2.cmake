# Defines the imported target aotgen::pcre2 (8-bit PCRE2) and sets aotgen_PCRE2_FOUND.
# Included by runtime/cpp/CMakeLists.txt and by the installed aotgenConfig.cmake, so that a
# consumer of the installed static libraries links the same PCRE2 the build used.
# Debian's libpcre2-dev ships no CMake config, so this asks pkg-config, then searches.
if(TARGET aotgen::pcre2)
  set(aotgen_PCRE2_FOUND TRUE)
  return()
endif()

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(aotgen_PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
endif()

if(TARGET PkgConfig::aotgen_PCRE2)
  add_library(aotgen::pcre2 INTERFACE IMPORTED)
  target_link_libraries(aotgen::pcre2 INTERFACE PkgConfig::aotgen_PCRE2)
  set(aotgen_PCRE2_FOUND TRUE)
else()
  find_path(aotgen_PCRE2_INCLUDE_DIR pcre2.h)
  find_library(aotgen_PCRE2_LIBRARY NAMES pcre2-8)
  if(aotgen_PCRE2_INCLUDE_DIR AND aotgen_PCRE2_LIBRARY)
    add_library(aotgen::pcre2 UNKNOWN IMPORTED)
    set_target_properties(aotgen::pcre2 PROPERTIES
      IMPORTED_LOCATION "${aotgen_PCRE2_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${aotgen_PCRE2_INCLUDE_DIR}")
    set(aotgen_PCRE2_FOUND TRUE)
  else()
    set(aotgen_PCRE2_FOUND FALSE)
  endif()
endif()
