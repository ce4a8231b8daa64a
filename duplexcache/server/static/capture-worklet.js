// AudioWorklet processor: microphone frames -> 24 kHz mono pcm16 chunks for the main thread.
//
// The browser delivers 128-frame blocks at the AudioContext's rate (`sampleRate`, a global of
// the worklet scope). When that is already 24 kHz this only converts; otherwise it resamples
// with a streaming linear interpolator after a box low-pass as wide as the rate ratio (enough for
// speech going down from 44.1/48 kHz; the phase carries across blocks so chunk edges don't click).
// Each posted chunk is {pcm: ArrayBuffer of Int16 LE, rms: level of the chunk in [0, 1]}.

const TARGET_RATE = 24000;

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const chunkMs = (options.processorOptions && options.processorOptions.chunkMs) || 40;
    this.chunkSamples = Math.round(TARGET_RATE * chunkMs / 1000);
    this.step = sampleRate / TARGET_RATE;      // input samples per output sample
    this.boxWidth = Math.max(1, Math.round(this.step));
    this.history = new Float32Array(this.boxWidth);  // last inputs, for the box filter
    this.historyPos = 0;
    this.boxSum = 0;
    this.prevFiltered = 0;   // filtered input sample just before the current block
    this.phase = 0;          // position of the next output sample, in input samples from prevFiltered
    this.out = new Int16Array(this.chunkSamples);
    this.outLen = 0;
    this.sumSquares = 0;
  }

  filter(x) {
    // Running mean of the last boxWidth inputs.
    this.boxSum += x - this.history[this.historyPos];
    this.history[this.historyPos] = x;
    this.historyPos = (this.historyPos + 1) % this.boxWidth;
    return this.boxSum / this.boxWidth;
  }

  emit(sample) {
    const clipped = Math.max(-1, Math.min(1, sample));
    this.out[this.outLen++] = clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff;
    this.sumSquares += clipped * clipped;
    if (this.outLen === this.chunkSamples) {
      const rms = Math.sqrt(this.sumSquares / this.chunkSamples);
      this.port.postMessage({pcm: this.out.buffer, rms}, [this.out.buffer]);
      this.out = new Int16Array(this.chunkSamples);
      this.outLen = 0;
      this.sumSquares = 0;
    }
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true;  // no input connected (yet)
    const input = channels[0];  // mono: the first channel is enough for speech
    if (this.step === 1) {
      for (let i = 0; i < input.length; i++) this.emit(input[i]);
      return true;
    }
    for (let i = 0; i < input.length; i++) {
      const cur = this.filter(input[i]);
      // Output samples that fall between prevFiltered (position 0) and cur (position 1).
      while (this.phase <= 1) {
        this.emit(this.prevFiltered + (cur - this.prevFiltered) * this.phase);
        this.phase += this.step;
      }
      this.phase -= 1;
      this.prevFiltered = cur;
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
