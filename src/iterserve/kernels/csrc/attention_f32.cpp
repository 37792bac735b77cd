// The attention loops for float32 queries: half of their instantiations, the other half being
// attention_bf16.cpp's (attention_plan.h says why two files).
#include "attention_loops.h"

namespace iterserve::attention {
template void run_items<float>(const Plan& plan, bool int8_cache, bool parallel);
}  // namespace iterserve::attention
