// Bootstrap key/value store. Transports publish their connection info under a key and read their peers'.
// Python fills it from a torch.distributed Store (uccl_moe/proxy.py, StoreBootstrap); C++ tests use the in-memory
// (threads) or file (processes) stores.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <string>

namespace uccl_moe {

class KvStore {
 public:
  virtual ~KvStore() = default;
  /// Publishes `value` (binary-safe) under `key`; may block briefly.
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// Returns the value of `key`, waiting for it up to `timeout_s`; throws Timeout naming the key on expiry.
  virtual std::string get(const std::string& key, double timeout_s) = 0;
};

/// Threads of one process.
class MemoryKvStore : public KvStore {
 public:
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

/// Processes of one host: one file per key in `dir` (written to a temporary name, then renamed).
class FileKvStore : public KvStore {
 public:
  explicit FileKvStore(std::string dir);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

/// Forwards to two callables (the Python binding wraps a torch.distributed Store this way). `get` must block until
/// the key exists or its own timeout passes, and may throw.
class CallbackKvStore : public KvStore {
 public:
  using SetFn = std::function<void(const std::string&, const std::string&)>;
  using GetFn = std::function<std::string(const std::string&, double)>;
  CallbackKvStore(SetFn set, GetFn get) : set_(std::move(set)), get_(std::move(get)) {}
  void set(const std::string& key, const std::string& value) override { set_(key, value); }
  std::string get(const std::string& key, double timeout_s) override { return get_(key, timeout_s); }

 private:
  SetFn set_;
  GetFn get_;
};

/// Little binary writer/reader for exchange blobs: a 4-byte magic, a version, then fields in order.
/// The reader throws Transport naming the blob on a short read, a bad magic or a version mismatch.
class BlobWriter {
 public:
  BlobWriter(uint32_t magic, uint16_t version);
  BlobWriter& u32(uint32_t v);
  BlobWriter& u64(uint64_t v);
  BlobWriter& bytes(const void* p, size_t n);
  BlobWriter& str(const std::string& s);
  const std::string& data() const { return buf_; }

 private:
  std::string buf_;
};

class BlobReader {
 public:
  BlobReader(const std::string& data, uint32_t magic, uint16_t version, const char* what);
  uint32_t u32();
  uint64_t u64();
  void bytes(void* p, size_t n);
  std::string str();
  bool done() const { return pos_ == data_.size(); }

 private:
  void need(size_t n);
  const std::string& data_;
  size_t pos_ = 0;
  const char* what_;
};

}  // namespace uccl_moe
