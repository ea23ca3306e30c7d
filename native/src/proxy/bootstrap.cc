#include "uccl_moe/bootstrap.hpp"

#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "uccl_moe/error.hpp"

namespace uccl_moe {

void MemoryKvStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    kv_[key] = value;
  }
  cv_.notify_all();
}

std::string MemoryKvStore::get(const std::string& key, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return kv_.count(key) != 0; }))
    UCCL_THROW(kTimeout, "bootstrap: key '%s' did not appear within %.1f s (a peer did not start its proxy?)",
               key.c_str(), timeout_s);
  return kv_[key];
}

FileKvStore::FileKvStore(std::string dir) : dir_(std::move(dir)) {
  if (mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) UCCL_CHECK_SYS(-1, "mkdir %s", dir_.c_str());
}

std::string FileKvStore::path_of(const std::string& key) const {
  std::string name;
  for (char c : key) name += (isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  return dir_ + "/" + name;
}

void FileKvStore::set(const std::string& key, const std::string& value) {
  const std::string path = path_of(key);
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(value.data(), std::streamsize(value.size()));
    if (!f) UCCL_THROW(kSystem, "bootstrap: cannot write %s", tmp.c_str());
  }
  UCCL_CHECK_SYS(std::rename(tmp.c_str(), path.c_str()), "rename %s", path.c_str());
}

std::string FileKvStore::get(const std::string& key, double timeout_s) {
  const std::string path = path_of(key);
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::stringstream ss;
      ss << f.rdbuf();
      return ss.str();
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s)
      UCCL_THROW(kTimeout, "bootstrap: key '%s' (%s) did not appear within %.1f s (a peer did not start its proxy?)",
                 key.c_str(), path.c_str(), timeout_s);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

BlobWriter::BlobWriter(uint32_t magic, uint16_t version) {
  u32(magic);
  u32(version);
}
BlobWriter& BlobWriter::u32(uint32_t v) { return bytes(&v, sizeof v); }
BlobWriter& BlobWriter::u64(uint64_t v) { return bytes(&v, sizeof v); }
BlobWriter& BlobWriter::bytes(const void* p, size_t n) {
  buf_.append(static_cast<const char*>(p), n);
  return *this;
}
BlobWriter& BlobWriter::str(const std::string& s) {
  u32(uint32_t(s.size()));
  return bytes(s.data(), s.size());
}

BlobReader::BlobReader(const std::string& data, uint32_t magic, uint16_t version, const char* what)
    : data_(data), what_(what) {
  const uint32_t m = u32();
  if (m != magic) UCCL_THROW(kTransport, "bootstrap: %s blob has magic 0x%08x, expected 0x%08x", what, m, magic);
  const uint32_t v = u32();
  if (v != version)
    UCCL_THROW(kTransport, "bootstrap: %s blob version %u, this build speaks %u (mixed uccl-moe versions?)", what, v,
               unsigned(version));
}
void BlobReader::need(size_t n) {
  if (pos_ + n > data_.size())
    UCCL_THROW(kTransport, "bootstrap: %s blob truncated (%zu bytes, need %zu at offset %zu)", what_, data_.size(), n,
               pos_);
}
uint32_t BlobReader::u32() {
  uint32_t v;
  bytes(&v, sizeof v);
  return v;
}
uint64_t BlobReader::u64() {
  uint64_t v;
  bytes(&v, sizeof v);
  return v;
}
void BlobReader::bytes(void* p, size_t n) {
  need(n);
  std::memcpy(p, data_.data() + pos_, n);
  pos_ += n;
}
std::string BlobReader::str() {
  const uint32_t n = u32();
  need(n);
  std::string s = data_.substr(pos_, n);
  pos_ += n;
  return s;
}

}  // namespace uccl_moe
