// Package checks (aotgen/package/manifest.py) and safetensors weights.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <cctype>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include <ATen/Version.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <nlohmann/json.hpp>
#include <openssl/evp.h>
#include <torch/version.h>

#include "cuda_graph.h"
#include "detail.h"

namespace aotgen {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace detail {

class Mapping {
 public:
  explicit Mapping(const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw PackageError("cannot open " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size == 0) {
      ::close(fd);
      throw PackageError("cannot read " + path.string() + " (empty or unreadable)");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    void* data = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (data == MAP_FAILED) {
      throw PackageError("cannot map " + path.string() + ": " + std::strerror(errno));
    }
    data_ = static_cast<char*>(data);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(data_, size_); }
  char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace detail

using detail::cuda_compute_capability;
using detail::cuda_problem;
using detail::Mapping;

namespace {

std::vector<std::string> hash_chunks(const Mapping& mapping, std::size_t chunk_bytes);

constexpr int kFormatVersion = 3;
constexpr const char* kManifest = "manifest.json";
constexpr std::array<std::string_view, 3> kIsaOrder = {"DEFAULT", "AVX2", "AVX512"};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw PackageError("cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Index in kIsaOrder; unknown ISAs rank above all (wanted) or at the bottom (available).
std::size_t isa_rank(std::string_view isa, std::size_t unknown) {
  const auto it = std::find(kIsaOrder.begin(), kIsaOrder.end(), isa);
  return it == kIsaOrder.end() ? unknown : static_cast<std::size_t>(it - kIsaOrder.begin());
}

// "2.13.0+cpu" -> "2.13.0": libtorch's TORCH_VERSION has no local (+cpu / +cu128) tag.
std::string public_version(const std::string& version) {
  return version.substr(0, version.find('+'));
}

void check_compatible(const json& manifest, const fs::path& root) {
  const auto built = manifest.at("torch_version").get<std::string>();
  if (public_version(built) != TORCH_VERSION) {
    throw PackageError(root.string() + " was built with torch " + built +
                       " but this runtime links libtorch " + TORCH_VERSION +
                       "; compiled AOTInductor code is tied to the torch version: rebuild the "
                       "package with torch " TORCH_VERSION " or rebuild aotgen-run against "
                       "torch " + public_version(built));
  }
  const auto& target = manifest.at("target");
  const auto device = target.value("device", std::string("cpu"));
  if (device == "cuda") {
    const std::string gpu = target.value("gpu", std::string("a CUDA GPU"));
    if (const auto problem = cuda_problem()) {
      throw PackageError(root.string() + " was built for a CUDA GPU (" + gpu + ") but " +
                         *problem + "; run it on such a machine with a runtime built against "
                         "CUDA libtorch, or build the recipe with `device: cpu`");
    }
    const auto want = target.at("compute_capability").get<std::string>();
    const auto have = cuda_compute_capability().value_or("none");
    if (want != have) {
      throw PackageError(root.string() + "'s GPU kernels were compiled for compute capability " +
                         want + " (" + gpu + "), this GPU is " + have +
                         "; rebuild the package on this machine");
    }
  } else if (device != "cpu") {
    throw PackageError(root.string() + " was built for device " + device +
                       "; this runtime runs CPU and CUDA packages");
  }
  const auto want_platform = target.at("platform").get<std::string>();
  if (want_platform != platform_string()) {
    throw PackageError(root.string() + " was built for " + want_platform +
                       ", this machine is " + platform_string());
  }
  const auto want_isa = target.at("isa").get<std::string>();
  const auto have_isa = cpu_capability();
  if (isa_rank(want_isa, kIsaOrder.size()) > isa_rank(have_isa, 0)) {
    throw PackageError(root.string() + " was compiled for " + want_isa +
                       " but this CPU supports " + have_isa +
                       "; rebuild the package on (or for) this machine");
  }
}

// A manifest path must stay inside the package: a normalised relative POSIX path, with no
// root, no "..", "." or empty parts and no backslash (manifest.py: _is_plain_relative).
bool inside_package(const std::string& rel) {
  if (rel.empty() || rel.front() == '/' || rel.find('\\') != std::string::npos) return false;
  std::size_t start = 0;
  while (true) {
    const std::size_t end = rel.find('/', start);
    const std::string_view part(rel.data() + start,
                                (end == std::string::npos ? rel.size() : end) - start);
    if (part.empty() || part == "." || part == "..") return false;
    if (end == std::string::npos) return true;
    start = end + 1;
  }
}

// Every package-relative path the runtimes open (manifest.py: referenced_files).
std::vector<std::string> referenced_files(const json& manifest) {
  std::vector<std::string> refs = {manifest.at("package").get<std::string>()};
  for (const auto& [role, model] : manifest.at("models").items()) {
    refs.push_back(model.at("weights").at("file").get<std::string>());
  }
  if (manifest.contains("ranks")) {
    for (const auto& rank : manifest.at("ranks")) {
      refs.push_back(rank.at("package").get<std::string>());
      for (const auto& [role, w] : rank.at("weights").items()) {
        refs.push_back(w.at("file").get<std::string>());
      }
    }
  }
  const auto& tok = manifest.at("tokenizer");
  const auto dir = tok.at("dir").get<std::string>();
  for (const auto& name : tok.at("files")) refs.push_back(dir + "/" + name.get<std::string>());
  return refs;
}

// A package is a closed set of files (manifest.py: check_paths): every path the manifest
// names is inside the package and listed with its hash, and no link leads out of it.
void check_paths(const json& manifest, const fs::path& root) {
  const auto& listed = manifest.at("files");
  if (!listed.is_object()) throw PackageError(root.string() + ": manifest `files` is malformed");
  for (const auto& [rel, entry] : listed.items()) {
    if (!inside_package(rel)) {
      throw PackageError(root.string() + ": manifest lists '" + rel +
                         "', a path outside the package; refusing");
    }
  }
  for (const auto& rel : referenced_files(manifest)) {
    if (!listed.contains(rel)) {
      throw PackageError(root.string() + ": manifest names '" + rel +
                         "', which is not a listed, hashed file of the package; refusing");
    }
  }
  const auto symlink = [&](const fs::path& path) {
    const auto rel = path.lexically_relative(root).generic_string();
    return PackageError(root.string() + ": " + rel +
                        " is a symbolic link; a package holds plain files only (copy it with "
                        "`cp -rL`); refusing");
  };
  for (const auto& item : fs::recursive_directory_iterator(root)) {
    if (item.is_symlink()) throw symlink(item.path());
  }
}

// Weights are data, not code: Engine::load checks their (large) hashes while the already
// verified graph code loads, and binds them only after. Everything else is checked first.
bool is_weights_file(const std::string& rel) {
  constexpr std::string_view kSuffix = ".safetensors";
  return rel.size() >= kSuffix.size() &&
         rel.compare(rel.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

// Hashes the listed files whose is_weights_file() equals `weights`; with !weights also
// checks that every listed file exists with its size and that nothing unlisted is there.
// With `mapped`, the weights files stay mapped there, by path, for binding.
void verify_files(const json& manifest, const fs::path& root, bool weights,
                  detail::MappedFiles* mapped = nullptr) {
  const auto& listed = manifest.at("files");
  if (!listed.is_object()) throw PackageError(root.string() + ": manifest `files` is malformed");
  const auto chunk_bytes = manifest.at("hash_chunk_bytes").get<std::size_t>();
  if (chunk_bytes == 0) throw PackageError(root.string() + ": manifest hash_chunk_bytes is 0");
  const auto mismatch = [&](const std::string& rel) {
    return PackageError(root.string() + ": " + rel +
                        " does not match its sha256 in the manifest (corrupt or tampered); "
                        "refusing to load native code from it. Rebuild the package");
  };
  for (const auto& [rel, entry] : listed.items()) {
    if (!inside_package(rel)) {
      throw PackageError(root.string() + ": manifest lists a file outside the package: " + rel);
    }
    const fs::path path = root / rel;
    if (!weights) {
      if (!fs::is_regular_file(path)) {
        throw PackageError(root.string() + ": file " + rel +
                           " is missing; rebuild or re-copy the package");
      }
      if (fs::file_size(path) != entry.at("bytes").get<std::uintmax_t>()) throw mismatch(rel);
    }
    if (is_weights_file(rel) != weights) continue;
    std::vector<std::string> digests;
    if (mapped != nullptr && fs::file_size(path) > 0) {
      auto mapping = std::make_shared<const Mapping>(path);
      digests = hash_chunks(*mapping, chunk_bytes);
      mapped->emplace(path.string(), std::move(mapping));
    } else {
      digests = sha256_chunks(path, chunk_bytes);
    }
    if (digests != entry.at("sha256").get<std::vector<std::string>>()) throw mismatch(rel);
  }
  if (weights) return;
  for (const auto& item : fs::recursive_directory_iterator(root)) {
    if (item.is_directory()) continue;
    const auto rel = item.path().lexically_relative(root).generic_string();
    if (rel != kManifest && !listed.contains(rel)) {
      throw PackageError(root.string() + ": unexpected file " + rel +
                         " not in the manifest; refusing");
    }
  }
}

// Size of one element of a safetensors dtype, and its torch type.
struct StDtype {
  at::ScalarType type;
  std::size_t bytes;
};

StDtype safetensors_dtype(const std::string& name) {
  static const std::unordered_map<std::string, StDtype> table = {
      {"F64", {at::kDouble, 8}}, {"F32", {at::kFloat, 4}},  {"F16", {at::kHalf, 2}},
      {"BF16", {at::kBFloat16, 2}}, {"I64", {at::kLong, 8}}, {"I32", {at::kInt, 4}},
      {"I16", {at::kShort, 2}},  {"I8", {at::kChar, 1}},    {"U8", {at::kByte, 1}},
      {"BOOL", {at::kBool, 1}},
  };
  const auto it = table.find(name);
  if (it == table.end()) throw PackageError("unsupported safetensors dtype " + name);
  return it->second;
}

std::string sha256_hex(const char* data, std::size_t size) {
  const std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(),
                                                                     &EVP_MD_CTX_free);
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx.get(), data, size) != 1 ||
      EVP_DigestFinal_ex(ctx.get(), digest.data(), &length) != 1) {
    throw std::runtime_error("OpenSSL: sha256 failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

// sha256 of each `chunk_bytes` chunk of a mapped file, hashed on all cores.
std::vector<std::string> hash_chunks(const Mapping& mapping, std::size_t chunk_bytes) {
  const std::size_t n = (mapping.size() + chunk_bytes - 1) / chunk_bytes;
  std::vector<std::string> digests(n);
  std::atomic<std::size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  const auto work = [&] {
    for (std::size_t i; (i = next++) < n;) {
      try {
        const std::size_t start = i * chunk_bytes;
        digests[i] = sha256_hex(mapping.data() + start,
                                std::min(chunk_bytes, mapping.size() - start));
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        error = std::current_exception();
      }
    }
  };
  const std::size_t workers =
      std::min<std::size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return digests;
}

}  // namespace

std::vector<std::string> sha256_chunks(const fs::path& path, std::size_t chunk_bytes) {
  if (fs::file_size(path) == 0) return {sha256_hex(nullptr, 0)};
  return hash_chunks(Mapping(path), chunk_bytes);
}

std::string cpu_capability() { return at::get_cpu_capability(); }

std::string platform_string() {
  struct utsname names {};
  if (::uname(&names) != 0) return "unknown";
  std::string system = names.sysname;
  std::transform(system.begin(), system.end(), system.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return system + "-" + names.machine;
}

std::string verify_package(const fs::path& root, bool check_hashes, bool defer_weights) {
  const fs::path path = root / kManifest;
  if (!fs::is_regular_file(path)) {
    throw PackageError(root.string() + " is not an aotgen package (no " + kManifest +
                       "); build one with `aotgen build RECIPE`");
  }
  std::string text = read_text(path);
  try {
    const json manifest = json::parse(text);
    if (!manifest.is_object() || !manifest.contains("format_version") ||
        manifest["format_version"] != kFormatVersion) {
      const auto got = manifest.is_object() ? manifest.value("format_version", json()).dump()
                                            : std::string("none");
      throw PackageError(root.string() + ": package format " + got + ", this runtime reads " +
                         "format " + std::to_string(kFormatVersion) +
                         "; rebuild the package with a matching aotgen");
    }
    check_compatible(manifest, root);
    check_paths(manifest, root);
    if (check_hashes) {
      verify_files(manifest, root, /*weights=*/false);
      if (!defer_weights) verify_files(manifest, root, /*weights=*/true);
    }
  } catch (const json::parse_error& e) {
    throw PackageError(path.string() + " is corrupt (" + e.what() + "); rebuild the package");
  } catch (const json::exception& e) {
    throw PackageError(path.string() + " is malformed (" + e.what() + "); rebuild the package");
  }
  return text;
}

namespace detail {

MappedFiles verify_weight_files(const std::string& manifest_text, const fs::path& root) {
  MappedFiles mapped;
  try {
    verify_files(json::parse(manifest_text), root, /*weights=*/true, &mapped);
  } catch (const json::exception& e) {
    throw PackageError(root.string() + "/manifest.json is malformed (" + e.what() +
                       "); rebuild the package");
  }
  return mapped;
}

at::ScalarType dtype_from_name(const std::string& name) {
  static const std::unordered_map<std::string, at::ScalarType> table = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
      {"float64", at::kDouble}, {"int8", at::kChar},   {"uint8", at::kByte},
  };
  const auto it = table.find(name);
  if (it == table.end()) throw PackageError("unsupported dtype " + name + " in the manifest");
  return it->second;
}

std::unordered_map<std::string, at::Tensor> load_safetensors(
    const fs::path& path, std::shared_ptr<const Mapping> mapping) {
  if (!mapping) mapping = std::make_shared<const Mapping>(path);
  const auto bad = [&](const std::string& why) {
    return PackageError(path.string() + " is not a valid safetensors file: " + why);
  };
  uint64_t header_len = 0;
  if (mapping->size() < 8) throw bad("too short");
  std::memcpy(&header_len, mapping->data(), 8);  // little-endian, as is every target here
  if (header_len > mapping->size() - 8) throw bad("header length past the end of the file");
  const char* base = mapping->data() + 8 + header_len;
  const std::size_t data_size = mapping->size() - 8 - header_len;

  json header;
  try {
    header = json::parse(std::string_view(mapping->data() + 8, header_len));
  } catch (const json::exception& e) {
    throw bad(e.what());
  }
  std::unordered_map<std::string, at::Tensor> tensors;
  for (const auto& [name, info] : header.items()) {
    // __pad*: fillers that keep every tensor 64-byte aligned (package/weights.py).
    if (name == "__metadata__" || name.rfind("__pad", 0) == 0) continue;
    try {
      const auto dtype = safetensors_dtype(info.at("dtype").get<std::string>());
      const auto shape = info.at("shape").get<std::vector<int64_t>>();
      const auto offsets = info.at("data_offsets").get<std::vector<std::size_t>>();
      std::size_t numel = 1;
      for (const auto d : shape) numel *= static_cast<std::size_t>(d);
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size ||
          offsets[1] - offsets[0] != numel * dtype.bytes) {
        throw bad("bad data_offsets for " + name);
      }
      char* data = const_cast<char*>(base) + offsets[0];
      const auto options = at::TensorOptions().dtype(dtype.type);
      if (reinterpret_cast<std::uintptr_t>(data) % 64 == 0) {
        // Zero copy: the tensor views the mapping and keeps it alive.
        tensors.emplace(name, at::from_blob(data, shape, [mapping](void*) {}, options));
      } else {
        at::Tensor t = at::empty(shape, options);
        std::memcpy(t.data_ptr(), data, numel * dtype.bytes);
        tensors.emplace(name, std::move(t));
      }
    } catch (const json::exception& e) {
      throw bad(name + ": " + e.what());
    }
  }
  return tensors;
}

}  // namespace detail
}  // namespace aotgen
